package main

// Loopback port selection.

import (
	"fmt"
	"net"
)

// freePort asks the kernel for an unused loopback port. The port is released
// before it is used, so another process could in theory grab it in between;
// the kernel hands out ephemeral ports in a randomised order, which makes
// that unlikely even with several instances starting at once.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("no free loopback port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// checkPortFree fails with a clear message if 127.0.0.1:port is taken.
func checkPortFree(port int) error {
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return fmt.Errorf("port %d on 127.0.0.1 is already in use (or not bindable): %w", port, err)
	}
	return l.Close()
}

// distinctFreePorts returns n different free ports.
func distinctFreePorts(n int, avoid ...int) ([]int, error) {
	seen := map[int]bool{}
	for _, p := range avoid {
		seen[p] = true
	}
	var out []int
	for tries := 0; len(out) < n && tries < 100; tries++ {
		p, err := freePort()
		if err != nil {
			return nil, err
		}
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	if len(out) < n {
		return nil, fmt.Errorf("could not find %d distinct free loopback ports", n)
	}
	return out, nil
}
