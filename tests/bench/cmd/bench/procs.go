package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is a child process with its output in a log file.
type proc struct {
	name    string
	cmd     *exec.Cmd
	log     string
	started time.Time
	done    chan struct{}
	err     error
}

var (
	procsMu sync.Mutex
	procs   = map[*proc]struct{}{}
)

func startProc(name, dir string, env []string, program string, args ...string) (*proc, error) {
	logPath := filepath.Join(dir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(program, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout = f
	cmd.Stderr = f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	p.started = time.Now()
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	procsMu.Lock()
	procs[p] = struct{}{}
	procsMu.Unlock()
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) alive() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// stop sends SIGTERM to the process group, then SIGKILL after the grace period.
func (p *proc) stop(grace time.Duration) {
	if p == nil {
		return
	}
	if p.alive() {
		_ = syscall.Kill(-p.pid(), syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(grace):
			_ = syscall.Kill(-p.pid(), syscall.SIGKILL)
			<-p.done
		}
	}
	procsMu.Lock()
	delete(procs, p)
	procsMu.Unlock()
}

// tail returns the last lines of the process log.
func (p *proc) tail(n int) string {
	data, _ := os.ReadFile(p.log)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func stopAll() {
	procsMu.Lock()
	all := make([]*proc, 0, len(procs))
	for p := range procs {
		all = append(all, p)
	}
	procsMu.Unlock()
	for _, p := range all {
		p.stop(10 * time.Second)
	}
}

// memory is VmRSS and VmHWM of a process, in KiB.
type memory struct {
	RSSKiB int64 `json:"rss_kib"`
	HWMKiB int64 `json:"hwm_kib"`
	// The resident set split: anonymous (heap, stacks) and file-backed (the binary's code).
	AnonKiB int64 `json:"anon_kib,omitempty"`
	FileKiB int64 `json:"file_kib,omitempty"`
}

func readMemory(pid int) (memory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return memory{}, err
	}
	defer f.Close()
	var m memory
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		v, _ := strconv.ParseInt(fields[1], 10, 64)
		switch fields[0] {
		case "VmRSS:":
			m.RSSKiB = v
		case "VmHWM:":
			m.HWMKiB = v
		case "RssAnon:":
			m.AnonKiB = v
		case "RssFile:":
			m.FileKiB = v
		}
	}
	return m, sc.Err()
}

// cpuSeconds is utime+stime of a process.
func cpuSeconds(pid int) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(data)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		s = s[i+2:]
	}
	f := strings.Fields(s)
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100.0 // USER_HZ is 100 on Linux
}

// waitFileNonEmpty polls a file until it has content; returns when it was first seen so.
func waitFileNonEmpty(path string, timeout time.Duration, alive func() bool) (time.Time, error) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if st, err := os.Stat(path); err == nil && st.Size() > 0 {
			return time.Now(), nil
		}
		if alive != nil && !alive() {
			return time.Time{}, fmt.Errorf("the process exited before %s was written", filepath.Base(path))
		}
		time.Sleep(time.Millisecond)
	}
	return time.Time{}, fmt.Errorf("%s stayed empty for %s", filepath.Base(path), timeout)
}

func countLines(path string) int {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	return strings.Count(string(data), "\n")
}

func countLinesMatching(path, substr string) int {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n := 0
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, substr) {
			n++
		}
	}
	return n
}

// startAPIServer starts the testenv API server (kube-apiserver with etcd) under work, with an
// audit log at audit when it is not empty, and waits until it is ready. It returns the process
// and its kubeconfig.
func startAPIServer(testenv, work, audit string) (*proc, string, error) {
	args := []string{"start", "--dir", filepath.Join(work, "apiserver"), "--timeout", "120s"}
	if audit != "" {
		// kube-apiserver rotates its audit log at 100 MB even with --audit-log-maxsize=0 (the
		// rotation library's default); a full run writes more, so raise the limit, and read
		// any rotated files too.
		args = append(args, "--audit-log", audit, "--", "--audit-log-maxsize=100000")
	}
	env, err := startProc("testenv", work, nil, testenv, args...)
	if err != nil {
		return nil, "", err
	}
	kubeconfig := filepath.Join(work, "apiserver", "kubeconfig")
	if _, err := waitFileNonEmpty(filepath.Join(work, "apiserver", "ready"), 150*time.Second, env.alive); err != nil {
		return nil, "", fmt.Errorf("the API server did not start: %w\n%s", err, env.tail(20))
	}
	return env, kubeconfig, nil
}
