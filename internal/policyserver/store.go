package policyserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
	"golang.org/x/sys/unix"

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

// Store keeps the policy set: policies and middlebox types by name, and
// the set's version, which every change raises. The embedded bbolt
// database (boltStore) is the default.
type Store interface {
	// Load reads the whole set: policies in evaluation order (priority,
	// then name), types by name.
	Load(ctx context.Context) (api.PolicySet, error)
	// PutPolicy and PutType store an object under its name, unless the
	// stored one is the same, and tell whether anything changed. A new
	// object beyond the bounds is refused with a *FullError.
	PutPolicy(ctx context.Context, p api.Policy) (bool, error)
	PutType(ctx context.Context, t api.MiddleboxType) (bool, error)
	// DeletePolicy and DeleteType remove an object and tell whether it was
	// there. A type that a stored policy names stays, refused with an
	// *api.TypeInUseError.
	DeletePolicy(ctx context.Context, name string) (bool, error)
	DeleteType(ctx context.Context, name string) (bool, error)
	// Register records an agent's poll; the registration lapses after
	// ttl without another. Agents lists the registrations in force, by
	// host.
	Register(ctx context.Context, reg api.AgentRegistration, ttl time.Duration) error
	Agents(ctx context.Context) ([]api.AgentRegistration, error)
	Close() error
}

// storeHealth is what a store's probe found last: whether the store can
// serve (etcd has a quorum, the Kubernetes API server answers). Stores
// that can lose their quorum embed it; the server asks it through
// quorumChecker.
type storeHealth struct {
	ok atomic.Bool
	// loaded is set once the set has been read: a replica started
	// without its store is unhealthy until then, whatever a probe finds.
	loaded atomic.Bool
	lost   string // what is wrong when !ok, for the error
	kube   bool   // the store is the Kubernetes API
	// onHealth, when set (before the probe starts), runs when ok changes.
	onHealth func()
}

// Healthy implements quorumChecker.
func (h *storeHealth) Healthy() bool { return h.ok.Load() }

// set records a probe's finding and returns the one before it.
func (h *storeHealth) set(ok bool) (was bool) {
	was = h.ok.Swap(ok)
	if was != ok && h.onHealth != nil {
		h.onHealth()
	}
	return was
}

// quorumNow fails at once, with a *NoQuorumError, when the last probe
// found no quorum: a request would only time out, and the client is better
// off asking another replica now.
func (h *storeHealth) quorumNow() error {
	if !h.ok.Load() {
		return h.noQuorum("")
	}
	return nil
}

// noQuorum implements quorumChecker: the store's error, with why added.
func (h *storeHealth) noQuorum(why string) error {
	msg := h.lost
	if why != "" {
		msg += ", " + why
	}
	return &NoQuorumError{Err: errors.New(msg), Kube: h.kube}
}

// boltStore keeps policies and middlebox types in a bbolt database, and
// the agents' registrations in memory (they are of the moment, and one
// server has them all).
type boltStore struct {
	db *bolt.DB

	regMu sync.Mutex
	regs  map[string]boltReg
}

type boltReg struct {
	api.AgentRegistration
	until time.Time
}

// Register implements Store.
func (s *boltStore) Register(_ context.Context, reg api.AgentRegistration, ttl time.Duration) error {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if s.regs == nil {
		s.regs = map[string]boltReg{}
	}
	now := time.Now()
	for h, r := range s.regs {
		if now.After(r.until) {
			delete(s.regs, h)
		}
	}
	if _, ok := s.regs[reg.Host]; !ok && len(s.regs) >= maxSeenHosts {
		return fmt.Errorf("%d agents registered already", maxSeenHosts)
	}
	s.regs[reg.Host] = boltReg{reg, now.Add(ttl)}
	return nil
}

// Agents implements Store.
func (s *boltStore) Agents(context.Context) ([]api.AgentRegistration, error) {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	now := time.Now()
	out := []api.AgentRegistration{}
	for _, r := range s.regs {
		if now.Before(r.until) {
			out = append(out, r.AgentRegistration)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Host < out[j].Host })
	return out, nil
}

var _ Store = (*boltStore)(nil)

// Load implements Store.
func (s *boltStore) Load(context.Context) (api.PolicySet, error) { return s.load() }

// PutPolicy implements Store.
func (s *boltStore) PutPolicy(_ context.Context, p api.Policy) (bool, error) {
	return s.put(bucketPolicies, p.Name, p)
}

// PutType implements Store.
func (s *boltStore) PutType(_ context.Context, t api.MiddleboxType) (bool, error) {
	return s.put(bucketTypes, t.Name, t)
}

// DeletePolicy implements Store.
func (s *boltStore) DeletePolicy(_ context.Context, name string) (bool, error) {
	return s.del(bucketPolicies, name)
}

// DeleteType implements Store.
func (s *boltStore) DeleteType(_ context.Context, name string) (bool, error) {
	return s.delType(name)
}

// Close implements Store.
func (s *boltStore) Close() error { return s.db.Close() }

// openStore opens (creating it and its directory if needed) the database at
// path. A database that bbolt cannot open, or whose pages do not check out,
// is refused with a *DamagedError, never a panic.
func openStore(path string) (*boltStore, error) {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("policy database: %w", err)
		}
	}
	db, err := openBolt(path, &bolt.Options{Timeout: time.Second})
	if err != nil {
		return nil, err
	}
	err = guard(func() error {
		if err := checkPages(db); err != nil {
			return err
		}
		return db.Update(func(tx *bolt.Tx) error {
			for _, b := range [][]byte{bucketMeta, bucketPolicies, bucketTypes} {
				if _, err := tx.CreateBucketIfNotExists(b); err != nil {
					return err
				}
			}
			return nil
		})
	})
	if err != nil {
		db.Close()
		return nil, &DamagedError{Path: path, Err: err}
	}
	return &boltStore{db: db}, nil
}

// openBolt opens the bbolt file at path, turning bbolt's panics on a
// damaged file (such as "invalid freelist page") into a *DamagedError.
func openBolt(path string, opts *bolt.Options) (*bolt.DB, error) {
	var db *bolt.DB
	var file *os.File
	o := *opts
	o.OpenFile = func(name string, flag int, perm os.FileMode) (*os.File, error) {
		f, err := os.OpenFile(name, flag, perm)
		file = f
		return f, err
	}
	err := guard(func() error {
		var err error
		db, err = bolt.Open(path, 0o600, &o)
		return err
	})
	if errors.Is(err, errPanic) && file != nil {
		// bbolt left the file open, locked and mapped when it
		// panicked; the mapping holds the file, so unlock it first.
		_ = unix.Flock(int(file.Fd()), unix.LOCK_UN)
		file.Close()
	}
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("policy database %s is locked by another process (is another dysco policy-server using it?)", path)
	}
	if errors.Is(err, bolterrors.ErrInvalid) || errors.Is(err, bolterrors.ErrChecksum) ||
		errors.Is(err, bolterrors.ErrVersionMismatch) || errors.Is(err, errPanic) {
		return nil, &DamagedError{Path: path, Err: err}
	}
	if err != nil {
		return nil, fmt.Errorf("policy database %s: %w", path, err)
	}
	return db, nil
}

// DamagedError says that the policy database is damaged, and what to do.
type DamagedError struct {
	Path string
	Err  error
}

func (e *DamagedError) Error() string {
	return fmt.Sprintf("policy database %s is damaged (%v); the policy server does not use it. "+
		"Check it with 'dysco policy-server check --db %s'; then restore a backup: the copy made at "+
		"the last start that found it sound (%s) or one made with 'dysco policy-server backup'; "+
		"or move the file away to start with an empty database", e.Path, e.Err, e.Path, BackupPath(e.Path))
}

func (e *DamagedError) Unwrap() error { return e.Err }

// BackupPath is where the server copies its database at each start that
// finds it sound: path with ".bak" appended.
func BackupPath(path string) string { return path + ".bak" }

// errPanic marks a panic of bbolt turned into an error by guard.
var errPanic = errors.New("bbolt panicked")

// guard runs f, turning a panic (bbolt panics on some damaged pages) and a
// fault on the mapped file into an error.
func guard(f func() error) (err error) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", errPanic, r)
		}
	}()
	return f()
}

// checkPages runs bbolt's consistency check over every page.
func checkPages(db *bolt.DB) error {
	return db.View(func(tx *bolt.Tx) error {
		var errs []error
		for err := range tx.Check() {
			errs = append(errs, err)
			if len(errs) == 10 {
				break
			}
		}
		return errors.Join(errs...)
	})
}

// backup copies the database to out, atomically (a temporary file renamed).
func (s *boltStore) backup(out string) error {
	tmp := out + ".tmp"
	err := guard(func() error {
		return s.db.View(func(tx *bolt.Tx) error { return tx.CopyFile(tmp, 0o600) })
	})
	if err == nil {
		err = os.Rename(tmp, out)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("policy database backup %s: %w", out, err)
	}
	return nil
}

// Summary describes a policy database that checked out.
type Summary struct {
	Version         uint64
	Policies, Types int
}

// Check opens the policy database at path read-only, checks every page and
// decodes every policy and type: `dysco policy-server check`. The server
// that uses the file must be stopped (it holds the file's lock).
func Check(path string) (Summary, error) {
	st, err := openReadOnly(path)
	if err != nil {
		return Summary{}, err
	}
	defer st.Close()
	var set api.PolicySet
	err = guard(func() error {
		if err := checkPages(st.db); err != nil {
			return err
		}
		set, err = st.load()
		return err
	})
	if err != nil {
		return Summary{}, &DamagedError{Path: path, Err: err}
	}
	return Summary{Version: set.Version, Policies: len(set.Policies), Types: len(set.Types)}, nil
}

// Backup checks the policy database at path as Check does, then copies it
// to out: `dysco policy-server backup`. A damaged database is not copied.
func Backup(path, out string) (Summary, error) {
	sum, err := Check(path)
	if err != nil {
		return sum, err
	}
	st, err := openReadOnly(path)
	if err != nil {
		return sum, err
	}
	defer st.Close()
	return sum, st.backup(out)
}

func openReadOnly(path string) (*boltStore, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("policy database: %w", err)
	}
	db, err := openBolt(path, &bolt.Options{Timeout: time.Second, ReadOnly: true})
	if err != nil {
		return nil, err
	}
	st := &boltStore{db: db}
	err = guard(func() error {
		return db.View(func(tx *bolt.Tx) error {
			for _, b := range [][]byte{bucketMeta, bucketPolicies, bucketTypes} {
				if tx.Bucket(b) == nil {
					return fmt.Errorf("no %s bucket: not a policy database", b)
				}
			}
			return nil
		})
	})
	if err != nil {
		db.Close()
		return nil, &DamagedError{Path: path, Err: err}
	}
	return st, nil
}

// load reads the whole set, policies sorted by priority then name and types
// by name.
func (s *boltStore) load() (api.PolicySet, error) {
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
func (s *boltStore) put(bucket []byte, name string, v any) (bool, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return false, err
	}
	changed := false
	err = s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucket)
		old := b.Get([]byte(name))
		if bytes.Equal(old, data) {
			return nil
		}
		if old == nil {
			if err := roomFor(b, bucket); err != nil {
				return err
			}
		}
		changed = true
		if err := b.Put([]byte(name), data); err != nil {
			return err
		}
		return bumpVersion(tx)
	})
	var full *FullError
	if errors.As(err, &full) {
		return false, err
	}
	if err != nil {
		return false, fmt.Errorf("writing policy database: %w", err)
	}
	return changed, nil
}

// FullError refuses a new policy or type beyond the bounds: at most
// api.MaxStoredPolicies policies and api.MaxTypes types (every agent gets
// every type, and its datapath holds MaxTypes).
type FullError struct {
	Kind  string
	Limit int
}

func (e *FullError) Error() string {
	return fmt.Sprintf("the policy server holds %d %s already, the most it takes: remove one first", e.Limit, e.Kind)
}

// roomFor checks that bucket may take one more key.
func roomFor(b *bolt.Bucket, bucket []byte) error {
	limit, kind := api.MaxStoredPolicies, "policies"
	if bytes.Equal(bucket, bucketTypes) {
		limit, kind = api.MaxTypes, "middlebox types"
	}
	n := 0
	c := b.Cursor()
	for k, _ := c.First(); k != nil; k, _ = c.Next() {
		if n++; n >= limit {
			return &FullError{Kind: kind, Limit: limit}
		}
	}
	return nil
}

// delType removes the middlebox type name, unless a stored policy names it
// (an *api.TypeInUseError naming those policies): checked and deleted in
// one transaction, so that no policy naming it can be stored in between.
func (s *boltStore) delType(name string) (bool, error) {
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
func (s *boltStore) del(bucket []byte, name string) (bool, error) {
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
