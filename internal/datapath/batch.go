package datapath

// Batched walks and deletions of maps.

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
)

// batchSize is how many entries one batch lookup reads: listing 100,000
// sessions takes tens of system calls, not hundreds of thousands.
const batchSize = 4096

// batchBufs keeps the buffers of the walks of one map from walk to walk:
// the collector walks the flows and sessions every second, and fresh
// buffers would be 1.5 MiB of garbage a second, which the agent's heap (and
// RSS) would grow by. A walk that finds them in use (walks run on several
// goroutines: collector, metrics, API) makes its own.
type batchBufs[K, V any] struct {
	mu   sync.Mutex
	keys []K
	vals []V
	// size is the batch, batchSize if 0: smaller for maps of big values
	// that hold few entries (the two-path records).
	size int
}

// eachBatch reads m in batches and calls fn for every entry, with the
// buffers of b (fn must not keep k or v).
func eachBatch[K, V any](m *ebpf.Map, what string, b *batchBufs[K, V], fn func(k *K, v *V)) error {
	var keys []K
	var vals []V
	size := batchSize
	if b.size > 0 {
		size = b.size
	}
	if b.mu.TryLock() {
		defer b.mu.Unlock()
		if b.keys == nil {
			b.keys, b.vals = make([]K, size), make([]V, size)
		}
		keys, vals = b.keys, b.vals
	} else {
		keys, vals = make([]K, size), make([]V, size)
	}
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := 0; i < n; i++ {
			fn(&keys[i], &vals[i])
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("datapath: list %s: %w", what, err)
		}
	}
}

// deleteBatch deletes keys from m with as few system calls as the kernel
// allows: a batch deletion stops at a key that is gone (the datapath may
// have freed it), so it goes on after that key. If batches are refused it
// deletes one key at a time. It returns how many keys were deleted.
func deleteBatch[K any](m *ebpf.Map, keys []K) int {
	deleted := 0
	for len(keys) > 0 {
		n, err := m.BatchDelete(keys, nil)
		deleted += n
		switch {
		case err == nil:
			return deleted
		case errors.Is(err, ebpf.ErrKeyNotExist) && n < len(keys):
			keys = keys[n+1:] // keys[n] is gone
		default:
			for i := n; i < len(keys); i++ {
				if m.Delete(&keys[i]) == nil {
					deleted++
				}
			}
			return deleted
		}
	}
	return deleted
}
