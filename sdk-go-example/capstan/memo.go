package capstan

import (
	"sync"
	"time"
)

// Memo holds values of one object kept in the handler process across invocations (kopf's
// memo); see [Invocation.Memo]. It is safe for concurrent use.
type Memo struct {
	m sync.Map
}

// Load returns the value stored under key, if any.
func (m *Memo) Load(key string) (value any, ok bool) { return m.m.Load(key) }

// Store sets the value under key.
func (m *Memo) Store(key string, value any) { m.m.Store(key, value) }

// LoadOrStore returns the value under key if there is one; otherwise it stores value and
// returns it. loaded reports whether the value was there.
func (m *Memo) LoadOrStore(key string, value any) (actual any, loaded bool) {
	return m.m.LoadOrStore(key, value)
}

// Delete removes the value under key.
func (m *Memo) Delete(key string) { m.m.Delete(key) }

// memoGrace is how long an object's memo outlives a successful delete handler, so that the
// other delete handlers of the same deletion still see it.
const memoGrace = time.Minute

// memos are the memos of a process, by object uid; "" is the operator-wide memo, which the
// activities get and every object's memo starts from (a shallow copy, as kopf makes).
type memos struct {
	mu       sync.Mutex
	byUID    map[string]*Memo
	doomed   map[string]time.Time // uid → when its memo is dropped
	operator Memo
}

// operatorMemo returns the operator-wide memo.
func (ms *memos) operatorMemo() *Memo { return &ms.operator }

// get returns the memo of uid, creating it on first use, and drops expired ones.
func (ms *memos) get(uid string) *Memo {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	now := time.Now()
	for id, at := range ms.doomed {
		if now.After(at) {
			delete(ms.byUID, id)
			delete(ms.doomed, id)
		}
	}
	if ms.byUID == nil {
		ms.byUID = map[string]*Memo{}
	}
	if uid == "" {
		return &ms.operator
	}
	m := ms.byUID[uid]
	if m == nil {
		m = &Memo{}
		ms.operator.m.Range(func(k, v any) bool {
			m.m.Store(k, v)
			return true
		})
		ms.byUID[uid] = m
	}
	return m
}

// drop forgets the memo of uid after grace (at once when grace is 0).
func (ms *memos) drop(uid string, grace time.Duration) {
	if uid == "" {
		return
	}
	ms.mu.Lock()
	defer ms.mu.Unlock()
	if grace <= 0 {
		delete(ms.byUID, uid)
		delete(ms.doomed, uid)
		return
	}
	if ms.doomed == nil {
		ms.doomed = map[string]time.Time{}
	}
	ms.doomed[uid] = time.Now().Add(grace)
}
