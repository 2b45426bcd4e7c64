package main

// Waiting for the API server, and the files written once it is ready.

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// adminHTTPClient talks to the API server as the admin client certificate.
func adminHTTPClient(p *pki) (*http.Client, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(p.caPEM) {
		return nil, fmt.Errorf("bad CA certificate")
	}
	cert, err := tls.X509KeyPair(p.adminCertPEM, p.adminKeyPEM)
	if err != nil {
		return nil, err
	}
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			Proxy:           nil, // loopback only, never via a proxy
			TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}},
		},
	}, nil
}

// waitReady polls until /readyz answers 200 and the "default" namespace
// exists (created by the apiserver's own bootstrap controller shortly after
// readyz), or the deadline passes.
func waitReady(c *http.Client, base string, deadline time.Time) error {
	last := "no answer yet"
	for _, path := range []string{"/readyz", "/api/v1/namespaces/default"} {
		for {
			resp, err := c.Get(base + path)
			if err == nil {
				body, _ := io.ReadAll(io.LimitReader(resp.Body, 16384))
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
				last = fmt.Sprintf("GET %s: HTTP %d: %s", path, resp.StatusCode, summarize(body))
			} else {
				last = fmt.Sprintf("GET %s: %v", path, err)
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("API server not ready before the startup timeout; last probe: %s", last)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return nil
}

// summarize shortens a probe answer to one line: the failing checks of a
// verbose /readyz answer, or the first 300 bytes of anything else.
func summarize(body []byte) string {
	var failing []string
	for _, line := range strings.Split(string(body), "\n") {
		if name, ok := strings.CutPrefix(line, "[-]"); ok {
			name, _, _ = strings.Cut(name, " ")
			failing = append(failing, name)
		}
	}
	if len(failing) > 0 {
		return "failing checks: " + strings.Join(failing, ", ")
	}
	s := strings.Join(strings.Fields(string(body)), " ")
	if len(s) > 300 {
		s = s[:300] + "..."
	}
	return s
}

// writeKubeconfig writes a self-contained admin kubeconfig (certificates
// inlined, no paths) atomically.
func writeKubeconfig(path, server string, p *pki) error {
	b64 := base64.StdEncoding.EncodeToString
	content := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: capstan-testenv
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: %s
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: capstan-testenv
  context:
    cluster: capstan-testenv
    user: %s
    namespace: default
current-context: capstan-testenv
preferences: {}
`, server, b64(p.caPEM), adminUser, b64(p.adminCertPEM), b64(p.adminKeyPEM), adminUser)
	return writeAtomic(path, []byte(content), 0o600)
}

// writeAtomic writes via a temporary file and rename, so readers never see
// a partial file.
func writeAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
