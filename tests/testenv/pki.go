package main

// Certificates and keys for one test instance: a throw-away CA, a serving
// certificate for the loopback address, an admin client certificate in the
// system:masters group, and the service-account token signing key.

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki holds the paths and PEM material the rest of the program needs.
type pki struct {
	dir          string
	caCertFile   string
	servingCert  string
	servingKey   string
	saKeyFile    string
	saPubFile    string
	caPEM        []byte
	adminCertPEM []byte
	adminKeyPEM  []byte
}

const (
	adminUser  = "capstan-admin"
	adminGroup = "system:masters"
	certLife   = 10 * 365 * 24 * time.Hour
)

// generatePKI writes everything into dir (created if needed).
func generatePKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &pki{
		dir:         dir,
		caCertFile:  filepath.Join(dir, "ca.crt"),
		servingCert: filepath.Join(dir, "apiserver.crt"),
		servingKey:  filepath.Join(dir, "apiserver.key"),
		saKeyFile:   filepath.Join(dir, "sa.key"),
		saPubFile:   filepath.Join(dir, "sa.pub"),
	}

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "capstan-testenv-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certLife),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	p.caPEM = pemBlock("CERTIFICATE", caDER)

	// Serving certificate: loopback plus the in-cluster names of the
	// "kubernetes" Service, so both kubectl and in-cluster-style clients verify.
	servingPEM, servingKeyPEM, err := leaf(caCert, caKey, &x509.Certificate{
		Subject: pkix.Name{CommonName: "kube-apiserver"},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.IPv6loopback, net.ParseIP(serviceIP)},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, now)
	if err != nil {
		return nil, fmt.Errorf("create serving certificate: %w", err)
	}

	// Admin client certificate: O=system:masters is bound to cluster-admin by
	// the bootstrap RBAC policy and may impersonate anyone.
	p.adminCertPEM, p.adminKeyPEM, err = leaf(caCert, caKey, &x509.Certificate{
		Subject:     pkix.Name{CommonName: adminUser, Organization: []string{adminGroup}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, now)
	if err != nil {
		return nil, fmt.Errorf("create admin certificate: %w", err)
	}

	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	saKeyPEM, err := pkcs8PEM(saKey)
	if err != nil {
		return nil, err
	}
	saPubDER, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		return nil, err
	}

	files := map[string][]byte{
		p.caCertFile:                    p.caPEM,
		p.servingCert:                   servingPEM,
		p.servingKey:                    servingKeyPEM,
		p.saKeyFile:                     saKeyPEM,
		p.saPubFile:                     pemBlock("PUBLIC KEY", saPubDER),
		filepath.Join(dir, "admin.crt"): p.adminCertPEM,
		filepath.Join(dir, "admin.key"): p.adminKeyPEM,
	}
	for path, data := range files {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// serviceIP is the first address of --service-cluster-ip-range, the
// ClusterIP of the "kubernetes" Service.
const serviceIP = "10.0.0.1"

func leaf(ca *x509.Certificate, caKey crypto.Signer, tmpl *x509.Certificate, now time.Time) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl.SerialNumber = serial()
	tmpl.NotBefore = now.Add(-time.Hour)
	tmpl.NotAfter = now.Add(certLife)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.BasicConstraintsValid = true
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return nil, nil, err
	}
	keyPEM, err = pkcs8PEM(key)
	if err != nil {
		return nil, nil, err
	}
	return pemBlock("CERTIFICATE", der), keyPEM, nil
}

func pkcs8PEM(key crypto.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pemBlock("PRIVATE KEY", der), nil
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	if err != nil {
		panic(err)
	}
	return n.Add(n, big.NewInt(1))
}
