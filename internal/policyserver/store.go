package policyserver

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/dysco/dysco/internal/api"
)

// The database holds one bucket per kind of object, keyed by name, with the
// JSON of the object as value, and the version in the meta bucket.
var (
	bucketMeta     = []byte("meta")
	bucketPolicies = []byte("policies")
	bucketTypes    = []byte("types")
	keyVersion     = []byte("version")
)

// store keeps policies and middlebox types in a bbolt database.
type store struct {
	db *bolt.DB
}

// openStore opens (creating it and its directory if needed) the database at path.
func openStore(path string) (*store, error) {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("policy database: %w", err)
		}
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("policy database %s is locked by another process (is another dysco policy-server using it?)", path)
	}
	if err != nil {
		return nil, fmt.Errorf("policy database %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketMeta, bucketPolicies, bucketTypes} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("policy database %s: %w", path, err)
	}
	return &store{db: db}, nil
}

func (s *store) close() error { return s.db.Close() }

// load reads the whole set, policies sorted by priority then name and types
// by name.
func (s *store) load() (api.PolicySet, error) {
	set := api.PolicySet{Policies: []api.Policy{}, Types: []api.MiddleboxType{}}
	err := s.db.View(func(tx *bolt.Tx) error {
		set.Version = version(tx)
		err := tx.Bucket(bucketPolicies).ForEach(func(k, v []byte) error {
			var p api.Policy
			if err := json.Unmarshal(v, &p); err != nil {
				return fmt.Errorf("policy %q: %w", k, err)
			}
			set.Policies = append(set.Policies, p)
			return nil
		})
		if err != nil {
			return err
		}
		return tx.Bucket(bucketTypes).ForEach(func(k, v []byte) error {
			var t api.MiddleboxType
			if err := json.Unmarshal(v, &t); err != nil {
				return fmt.Errorf("type %q: %w", k, err)
			}
			set.Types = append(set.Types, t)
			return nil
		})
	})
	if err != nil {
		return api.PolicySet{}, fmt.Errorf("reading policy database: %w", err)
	}
	sortSet(&set)
	return set, nil
}

// sortSet puts policies in evaluation order (priority, then name); bbolt
// already gives names in order.
func sortSet(set *api.PolicySet) {
	sort.SliceStable(set.Policies, func(i, j int) bool {
		a, b := set.Policies[i], set.Policies[j]
		if a.Priority != b.Priority {
			return a.Priority < b.Priority
		}
		return a.Name < b.Name
	})
	sort.SliceStable(set.Types, func(i, j int) bool { return set.Types[i].Name < set.Types[j].Name })
}

func version(tx *bolt.Tx) uint64 {
	v := tx.Bucket(bucketMeta).Get(keyVersion)
	if len(v) != 8 {
		return 0
	}
	return binary.BigEndian.Uint64(v)
}

func bumpVersion(tx *bolt.Tx) error {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], version(tx)+1)
	return tx.Bucket(bucketMeta).Put(keyVersion, b[:])
}

// put stores v under name in bucket and bumps the version, unless the stored
// value is already the same: a repeated PUT changes nothing and wakes no
// watcher. It tells whether anything changed.
func (s *store) put(bucket []byte, name string, v any) (bool, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return false, err
	}
	changed := false
	err = s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucket)
		if bytes.Equal(b.Get([]byte(name)), data) {
			return nil
		}
		changed = true
		if err := b.Put([]byte(name), data); err != nil {
			return err
		}
		return bumpVersion(tx)
	})
	if err != nil {
		return false, fmt.Errorf("writing policy database: %w", err)
	}
	return changed, nil
}

// delete removes name from bucket; a type is refused while a policy names it.
func (st *store) delete(bucket []byte, name string) (bool, error) {
	if bytes.Equal(bucket, bucketTypes) {
		return st.delType(name)
	}
	return st.del(bucket, name)
}

// delType removes the middlebox type name, unless a stored policy names it
// (an *api.TypeInUseError naming those policies): checked and deleted in
// one transaction, so that no policy naming it can be stored in between.
func (s *store) delType(name string) (bool, error) {
	found := false
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketTypes)
		if b.Get([]byte(name)) == nil {
			return nil
		}
		found = true
		var pols []api.Policy
		err := tx.Bucket(bucketPolicies).ForEach(func(k, v []byte) error {
			var p api.Policy
			if err := json.Unmarshal(v, &p); err != nil {
				return fmt.Errorf("policy %q: %w", k, err)
			}
			pols = append(pols, p)
			return nil
		})
		if err != nil {
			return err
		}
		if users := api.PoliciesUsingType(pols, name); len(users) > 0 {
			return &api.TypeInUseError{Type: name, Policies: users}
		}
		if err := b.Delete([]byte(name)); err != nil {
			return err
		}
		return bumpVersion(tx)
	})
	var inUse *api.TypeInUseError
	if errors.As(err, &inUse) {
		return true, err
	}
	if err != nil {
		return false, fmt.Errorf("writing policy database: %w", err)
	}
	return found, nil
}

// del removes name from bucket and bumps the version; it tells whether name was there.
func (s *store) del(bucket []byte, name string) (bool, error) {
	found := false
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucket)
		if b.Get([]byte(name)) == nil {
			return nil
		}
		found = true
		if err := b.Delete([]byte(name)); err != nil {
			return err
		}
		return bumpVersion(tx)
	})
	if err != nil {
		return false, fmt.Errorf("writing policy database: %w", err)
	}
	return found, nil
}
