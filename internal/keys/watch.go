package keys

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// DefaultPoll is how often a File looks at its key file for changes.
const DefaultPoll = time.Second

// File is a key file that an agent keeps loaded: it reads it again on
// SIGHUP, and when a poll finds the file changed (its size, times, inode
// or mode) and the next finds it unchanged since, without a restart. A file that no longer loads (a typo, a mode
// too open) is refused and logged, and the ring in use stays.
type File struct {
	path string
	uid  int
	log  *slog.Logger

	ring atomic.Pointer[Ring]

	mu      sync.Mutex
	stamp   fileStamp // of the file last read
	pending fileStamp // of the file at the last poll
	subs    []func(*Ring)
	reloads atomic.Uint64 // rings taken after the first
	errors  atomic.Uint64 // loads refused
}

// Open loads the key file at path (Load, owner root or uid) and returns it
// for Start.
func Open(path string, uid int, log *slog.Logger) (*File, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	f := &File{path: path, uid: uid, log: log}
	st, _ := stampOf(path)
	r, err := Load(path, uid)
	if err != nil {
		return nil, err
	}
	f.stamp, f.pending = st, st
	f.ring.Store(r)
	log.Info("control keys loaded", "file", path, "active", r.IDs(), "signing", r.IDs()[0])
	return f, nil
}

// Path is the key file's path.
func (f *File) Path() string { return f.path }

// Ring is the ring in use.
func (f *File) Ring() *Ring { return f.ring.Load() }

// Reloads counts the rings taken after the first; Errors the loads refused.
func (f *File) Reloads() uint64 { return f.reloads.Load() }

// Errors counts the reloads refused (the ring in use stayed).
func (f *File) Errors() uint64 { return f.errors.Load() }

// OnChange calls fn with every new ring, from the goroutine that loaded
// it, in order.
func (f *File) OnChange(fn func(*Ring)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.subs = append(f.subs, fn)
}

// Reload reads the file again. A ring equal to the one in use changes
// nothing; one that does not load is logged and counted, and the ring in
// use stays. It returns the load's error.
func (f *File) Reload() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reloadLocked()
}

func (f *File) reloadLocked() error {
	st, _ := stampOf(f.path)
	f.stamp, f.pending = st, st
	r, err := Load(f.path, f.uid)
	if err != nil {
		f.errors.Add(1)
		f.log.Error("control keys not reloaded; the keys in use stay", "file", f.path, "err", err,
			"active", f.Ring().IDs())
		return err
	}
	if r.Equal(f.Ring()) {
		return nil
	}
	f.ring.Store(r)
	f.reloads.Add(1)
	f.log.Info("control keys reloaded", "file", f.path, "active", r.IDs(), "signing", r.IDs()[0])
	for _, fn := range f.subs {
		fn(r)
	}
	return nil
}

// Start reloads the file on SIGHUP and when polls every interval
// (DefaultPoll if 0) find it changed and then steady, until ctx ends. SIGHUP is caught
// from the moment Start returns.
func (f *File) Start(ctx context.Context, interval time.Duration) {
	if interval <= 0 {
		interval = DefaultPoll
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		defer signal.Stop(hup)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				f.log.Info("SIGHUP: reloading control keys", "file", f.path)
				_ = f.Reload()
			case <-t.C:
				f.poll()
			}
		}
	}()
}

// poll reloads the file if it changed since it was last read and has
// stayed as it is since the previous poll: a file being written (an
// editor saving in place) is read once it is whole, not half-way, when a
// half might parse as a ring of fewer keys.
func (f *File) poll() {
	st, err := stampOf(f.path)
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil && st == f.stamp {
		f.pending = st
		return
	}
	if err != nil && f.stamp == (fileStamp{}) {
		return // still missing: logged once already
	}
	if err == nil && st != f.pending {
		f.pending = st // changed: read it once it has stayed so for a poll
		return
	}
	_ = f.reloadLocked()
}

// fileStamp is what changes when a file is written, replaced or chmod-ed.
type fileStamp struct {
	ino, dev uint64
	size     int64
	mtime    int64
	ctime    int64
	mode     uint32
}

func stampOf(path string) (fileStamp, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return fileStamp{}, err
	}
	return fileStamp{ino: st.Ino, dev: st.Dev, size: st.Size, mtime: st.Mtim.Nano(), ctime: st.Ctim.Nano(), mode: st.Mode}, nil
}
