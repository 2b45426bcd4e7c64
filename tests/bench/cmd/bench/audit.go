package main

import (
	"bufio"
	"encoding/json"
	"os"
	"strings"
	"time"
)

type auditEvent struct {
	Stage     string `json:"stage"`
	Verb      string `json:"verb"`
	UserAgent string `json:"userAgent"`
	User      struct {
		Username string `json:"username"`
	} `json:"user"`
	ObjectRef struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
	} `json:"objectRef"`
	StageTimestamp time.Time `json:"stageTimestamp"`
}

// countWrites fills in the B4 scenarios' write and read counts from the audit log: requests by
// the controller (anything but the benchmark driver and the API server itself) in the
// scenario's namespace and time window. A namespace "ns#name" counts only requests on that
// object and on Events.
func countWrites(paths []string, scenarios []*b4Result) error {
	for _, s := range scenarios {
		s.Writes = map[string]int{}
	}
	if len(paths) == 0 {
		return os.ErrNotExist
	}
	for _, path := range paths {
		if err := countFile(path, scenarios); err != nil {
			return err
		}
	}
	return nil
}

func countFile(path string, scenarios []*b4Result) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !strings.Contains(string(line), `"ResponseComplete"`) {
			continue
		}
		var ev auditEvent
		if err := json.Unmarshal(line, &ev); err != nil {
			continue
		}
		if ev.Stage != "ResponseComplete" || ev.ObjectRef.Namespace == "" ||
			strings.HasPrefix(ev.UserAgent, "capstan-bench/driver") || ev.User.Username == "system:apiserver" {
			continue
		}
		for _, s := range scenarios {
			ns, name, _ := strings.Cut(s.Namespace, "#")
			if ev.ObjectRef.Namespace != ns || ev.StageTimestamp.Before(s.From) || ev.StageTimestamp.After(s.To) {
				continue
			}
			if s.ObjectOnly && ev.ObjectRef.Resource != "examples" {
				continue
			}
			if name != "" && ev.ObjectRef.Resource == "examples" && ev.ObjectRef.Name != "" && ev.ObjectRef.Name != name {
				continue
			}
			s.UserAgents = addOnce(s.UserAgents, strings.SplitN(ev.UserAgent, " ", 2)[0])
			switch ev.Verb {
			case "create", "update", "patch", "delete", "deletecollection":
				key := strings.ToUpper(verbName(ev.Verb)) + " " + ev.ObjectRef.Resource
				if ev.ObjectRef.Subresource != "" {
					key += "/" + ev.ObjectRef.Subresource
				}
				s.Writes[key]++
				s.Total++
				if ev.ObjectRef.Resource == "events" {
					s.Events++
				} else {
					s.ObjectWrites++
				}
			case "get", "list":
				s.Reads++
			}
		}
	}
	return sc.Err()
}

func verbName(v string) string {
	if v == "create" {
		return "post"
	}
	return v
}

func addOnce(list []string, s string) []string {
	for _, x := range list {
		if x == s {
			return list
		}
	}
	return append(list, s)
}
