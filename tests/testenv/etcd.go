package main

// A single-member etcd running inside this process, for tests only
// (fsync disabled, data removed on exit).

import (
	"fmt"
	"net/url"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// etcdLogLevel can be raised while etcd is being stopped on purpose, so the
// expected "server closed" errors do not look like failures.
var etcdLogLevel = zap.NewAtomicLevelAt(zapcore.ErrorLevel)

func etcdLogger(level string) (*zap.Logger, error) {
	if err := etcdLogLevel.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--etcd-log-level: %w", err)
	}
	zc := zap.NewProductionConfig()
	zc.Level = etcdLogLevel
	zc.Sampling = nil
	zc.OutputPaths = []string{"stderr"}
	zc.ErrorOutputPaths = []string{"stderr"}
	return zc.Build()
}

// quietEtcd silences etcd before a deliberate stop.
func quietEtcd() { etcdLogLevel.SetLevel(zapcore.FatalLevel) }

// startEtcd starts etcd with its data under dataDir, serving clients on
// 127.0.0.1:clientPort, and waits until it is ready or the deadline passes.
func startEtcd(dataDir string, clientPort, peerPort int, logLevel string, deadline time.Time) (*embed.Etcd, error) {
	clientURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peerURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}

	cfg := embed.NewConfig()
	cfg.Name = "capstan-testenv"
	cfg.Dir = dataDir
	cfg.ListenClientUrls = []url.URL{clientURL}
	cfg.AdvertiseClientUrls = []url.URL{clientURL}
	cfg.ListenPeerUrls = []url.URL{peerURL}
	cfg.AdvertisePeerUrls = []url.URL{peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	logger, err := etcdLogger(logLevel)
	if err != nil {
		return nil, err
	}
	cfg.Logger = "zap"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(logger)
	cfg.UnsafeNoFsync = true // test data only; it is deleted on exit anyway
	// Same object size limit a kube-apiserver deployment usually gives etcd.
	cfg.MaxRequestBytes = 3 * 1024 * 1024

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("start embedded etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("embedded etcd failed: %w", err)
	case <-time.After(time.Until(deadline)):
		e.Close()
		return nil, fmt.Errorf("embedded etcd not ready before the startup timeout")
	}
}
