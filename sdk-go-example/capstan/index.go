package capstan

import (
	"encoding/json"
	"sort"
	"sync"
)

// This file keeps the indexes of a process (kopf's @kopf.index). The controller calls an
// index handler for every object of its resource, again on every change, and with
// IndexDeleted when the object leaves (deleted, or no longer matching the filters); the
// results are folded in here as kopf folds them, and handlers read them with
// [Invocation.Index]. Indexes belong to one stream (a session): a new stream starts with
// empty indexes, since the controller feeds every object again before any other handler of
// the process runs, and an index handler of a lost stream that answers late folds its result
// into the lost stream's indexes, which no one reads any more.

// IndexKey is a key of an index: the keys of a map result, or [NoneKey] for every other
// result (kopf's None key).
type IndexKey struct {
	Key  string
	None bool
}

// NoneKey is kopf's None key.
var NoneKey = IndexKey{None: true}

// Key returns the index key k.
func Key(k string) IndexKey { return IndexKey{Key: k} }

// objectKey identifies an object in an index, as kopf does.
type objectKey struct{ namespace, name, uid string }

// Index is one index as handlers read it (kopf's Index): a live, read-only mapping from keys
// to the values of every object under them. It is safe for concurrent use.
type Index struct {
	name     string
	mu       sync.RWMutex
	byKey    map[IndexKey]map[objectKey]any
	byObject map[string]held // by uid: the uid alone finds an object
}

// held is what one object holds in an index.
type held struct {
	key  objectKey
	keys []IndexKey
}

// Name returns the index's name: its handler's id.
func (x *Index) Name() string { return x.name }

// Get returns the values under key (kopf's Store), ordered by object, or nil when there are
// none.
func (x *Index) Get(key IndexKey) []any {
	x.mu.RLock()
	defer x.mu.RUnlock()
	store := x.byKey[key]
	if len(store) == 0 {
		return nil
	}
	objects := make([]objectKey, 0, len(store))
	for o := range store {
		objects = append(objects, o)
	}
	sort.Slice(objects, func(i, j int) bool {
		a, b := objects[i], objects[j]
		if a.namespace != b.namespace {
			return a.namespace < b.namespace
		}
		if a.name != b.name {
			return a.name < b.name
		}
		return a.uid < b.uid
	})
	values := make([]any, len(objects))
	for i, o := range objects {
		values[i] = store[o]
	}
	return values
}

// Keys returns the keys that hold values, the None key first, then sorted.
func (x *Index) Keys() []IndexKey {
	x.mu.RLock()
	defer x.mu.RUnlock()
	keys := make([]IndexKey, 0, len(x.byKey))
	for k := range x.byKey {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].None != keys[j].None {
			return keys[i].None
		}
		return keys[i].Key < keys[j].Key
	})
	return keys
}

// Len returns how many keys hold values.
func (x *Index) Len() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.byKey)
}

// Objects returns how many objects have entries.
func (x *Index) Objects() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.byObject)
}

// remove drops the entries of o (found by its uid).
func (x *Index) remove(o objectKey) {
	h, ok := x.byObject[o.uid]
	if !ok {
		return
	}
	for _, k := range h.keys {
		if store := x.byKey[k]; store != nil {
			delete(store, h.key)
			if len(store) == 0 {
				delete(x.byKey, k)
			}
		}
	}
	delete(x.byObject, o.uid)
}

// fold applies one result of o's index handler with kopf's rules: a map gives keys and
// values, any other non-nil value goes under the None key, nil (or JSON null) changes nothing.
func (x *Index) fold(o objectKey, value any) {
	if value == nil {
		return
	}
	// Normalise through JSON, as the value would travel: structs become maps.
	if raw, err := json.Marshal(value); err == nil {
		var decoded any
		if json.Unmarshal(raw, &decoded) == nil {
			value = decoded
		}
	}
	if value == nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.remove(o)
	entries := map[IndexKey]any{}
	if m, ok := value.(map[string]any); ok {
		for k, v := range m {
			entries[Key(k)] = v
		}
	} else {
		entries[NoneKey] = value
	}
	h := held{key: o}
	for k, v := range entries {
		if x.byKey[k] == nil {
			x.byKey[k] = map[objectKey]any{}
		}
		x.byKey[k][o] = v
		h.keys = append(h.keys, k)
	}
	if len(h.keys) > 0 {
		x.byObject[o.uid] = h
	}
}

// drop removes o's entries (the object left, or its handler failed).
func (x *Index) drop(o objectKey) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.remove(o)
}

// clear empties the index.
func (x *Index) clear() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.byKey = map[IndexKey]map[objectKey]any{}
	x.byObject = map[string]held{}
}

// indexes are the indexes of one session, by index handler id. The set of names is fixed
// when the session starts; each index guards its own entries.
type indexes struct {
	byName map[string]*Index
}

// newIndexes returns empty indexes with the given names.
func newIndexes(names []string) *indexes {
	xs := &indexes{byName: make(map[string]*Index, len(names))}
	for _, n := range names {
		x := &Index{name: n}
		x.clear()
		xs.byName[n] = x
	}
	return xs
}

// get returns the index name, or nil.
func (xs *indexes) get(name string) *Index {
	if xs == nil {
		return nil
	}
	return xs.byName[name]
}

// names returns the index names, sorted.
func (xs *indexes) names() []string {
	names := make([]string, 0, len(xs.byName))
	for n := range xs.byName {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
