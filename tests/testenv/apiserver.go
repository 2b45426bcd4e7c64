package main

// The kube-apiserver command line for one test instance.

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// auditPolicy records every request once it completes (or, for watches,
// once the response starts) at Metadata level: user, verb, resource,
// namespace/name, response code; no bodies.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages:
- RequestReceived
rules:
- level: Metadata
`

type apiserverConfig struct {
	port       int
	etcdPort   int
	pki        *pki
	auditLog   string // "" = no audit log
	policyFile string
	verbosity  int
	extraArgs  []string
}

func apiserverArgs(c apiserverConfig) ([]string, error) {
	args := []string{
		"--etcd-servers=http://127.0.0.1:" + strconv.Itoa(c.etcdPort),
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(c.port),
		// The "kubernetes" Endpoints cannot hold a loopback address, and
		// there is nothing to reconcile with a single test server.
		"--advertise-address=127.0.0.1",
		"--endpoint-reconciler-type=none",
		"--cert-dir=" + c.pki.dir,
		"--tls-cert-file=" + c.pki.servingCert,
		"--tls-private-key-file=" + c.pki.servingKey,
		"--client-ca-file=" + c.pki.caCertFile,
		"--authorization-mode=Node,RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + c.pki.saPubFile,
		"--service-account-signing-key-file=" + c.pki.saKeyFile,
		"--service-cluster-ip-range=10.0.0.0/24",
		// No kube-controller-manager runs, so no namespace gets a "default"
		// ServiceAccount; without this every Pod create would be rejected.
		"--disable-admission-plugins=ServiceAccount",
		"--allow-privileged=true",
		"--v=" + strconv.Itoa(c.verbosity),
	}
	if c.auditLog != "" {
		if err := os.MkdirAll(filepath.Dir(c.auditLog), 0o755); err != nil {
			return nil, fmt.Errorf("audit log directory: %w", err)
		}
		if err := os.WriteFile(c.policyFile, []byte(auditPolicy), 0o600); err != nil {
			return nil, err
		}
		args = append(args,
			"--audit-policy-file="+c.policyFile,
			"--audit-log-path="+c.auditLog,
			"--audit-log-format=json",
			"--audit-log-mode=blocking", // written before the response, no batching delay
			"--audit-log-maxsize=0",     // never rotate
		)
	}
	return append(args, c.extraArgs...), nil
}
