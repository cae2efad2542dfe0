// Package psclient is the agent's side of the policy server
// (internal/policyserver): Watch follows the policies meant for an agent
// through the server's long poll (/v1/watch) and keeps a cache of them;
// ServeOperations carries out the operator verbs the server relays. It
// needs neither the server nor its database, so that an agent links
// neither. The wire types are those of internal/api; the bounds both sides
// must agree on (the watch's waits, an operation's deadline) are here.
package psclient

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// Bounds of the watch route, the server's and the agent's alike.
const (
	// DefaultWait is how long a watch waits for a change when the request
	// does not say; MaxWait is the most it may ask for.
	DefaultWait = 30 * time.Second
	MaxWait     = 120 * time.Second
)

// Back-off between failed polls: doubling from minBackoff to maxBackoff,
// each wait drawn at random from its upper half so that agents restarted
// together do not poll in step.
var (
	minBackoff = 100 * time.Millisecond
	maxBackoff = 10 * time.Second
)

// WatchConfig configures Watch.
type WatchConfig struct {
	// URL is the policy server, "https://host:7017".
	URL string
	// TLS, when set, is the agent's client certificate and the CA that
	// signs the server's (internal/certs.ClientTLS); nil for a server
	// started with --insecure (an http:// URL).
	TLS *tls.Config
	// Host is the agent's name; the server gives it the policies whose Hosts
	// is empty or names it.
	Host string
	// Version is the agent's release and wire versions, for its
	// registration at the server (`dysco status --cluster`).
	Version string
	// CacheFile, when set, keeps the last set received so that an agent
	// restarted while the server is down starts with its last policies.
	CacheFile string
	// OnUpdate receives each newer policy set, the cached one first. Calls
	// come from Watch's goroutine, one at a time, with increasing versions.
	OnUpdate func(api.PolicySet)
	// OnStatus is told after every poll whether the server answered, and
	// the error when it did not.
	OnStatus func(ok bool, err error)
	// Wait is how long each long poll may wait for a change (DefaultWait
	// when zero; whole seconds, at most MaxWait).
	Wait time.Duration
	// Logger receives structured logs (slog.Default() when nil).
	Logger *slog.Logger
}

// pollWait is the wait of a long poll asked for as w: DefaultWait when not
// positive, whole seconds, from 1 s (wait=0 would make the server answer at
// once, every time) to MaxWait.
func pollWait(w time.Duration) time.Duration {
	if w <= 0 {
		w = DefaultWait
	}
	return max(min(w.Round(time.Second), MaxWait), time.Second)
}

// sleepBackoff waits a time drawn from the upper half of *backoff, then
// doubles *backoff up to maxBackoff; it returns false if ctx ended first.
func sleepBackoff(ctx context.Context, backoff *time.Duration) bool {
	d := *backoff/2 + rand.N(*backoff/2+1)
	*backoff = min(2**backoff, maxBackoff)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// cacheFile is the content of WatchConfig.CacheFile: the policy set, plus
// the host it was given to. A plain api.PolicySet also loads.
type cacheFile struct {
	api.PolicySet
	Host string `json:"host,omitempty"`
}

// Watch follows the policy server for an agent until ctx is done, and then
// returns nil; it returns an error only for a bad cfg.
//
// It first delivers the cached set, if any, then long-polls /v1/watch,
// backing off from 100 ms to 10 s (jittered) while the server is
// unreachable. Each set newer than the last delivered is written to the
// cache (atomically) and then delivered; older or equal versions never are.
func Watch(ctx context.Context, cfg WatchConfig) error {
	if cfg.URL == "" {
		return errors.New("policy watch: no policy server URL")
	}
	if cfg.Host == "" {
		return errors.New("policy watch: no host name (the server picks the policies by host)")
	}
	log := agentLogger(cfg.Logger, cfg.URL, cfg.Host)
	wait := pollWait(cfg.Wait)
	update := func(set api.PolicySet) {
		if cfg.OnUpdate != nil {
			cfg.OnUpdate(set)
		}
	}
	status := func(ok bool, err error) {
		if cfg.OnStatus != nil {
			cfg.OnStatus(ok, err)
		}
	}

	var last uint64
	if cfg.CacheFile != "" {
		set, err := readCache(cfg.CacheFile, cfg.Host)
		switch {
		case err == nil:
			log.Info("policies loaded from cache", "file", cfg.CacheFile, "version", set.Version, "policies", len(set.Policies))
			last = set.Version
			update(set)
		case errors.Is(err, os.ErrNotExist):
		default:
			log.Warn("ignoring the policy cache", "err", err)
		}
	}

	c := api.NewServerClientTLS(cfg.URL, cfg.TLS)
	backoff := minBackoff
	failing, warnedOlder := false, false
	for ctx.Err() == nil {
		set, err := c.Watch(ctx, cfg.Host, last, wait, cfg.Version)
		if ctx.Err() != nil {
			break
		}
		if err != nil {
			status(false, err)
			var he *api.HTTPError
			if !failing && errors.As(err, &he) && (he.StatusCode == http.StatusUnauthorized || he.StatusCode == http.StatusForbidden) {
				// Not a passing outage: the certificate needs attention.
				log.Error("the policy server refused this agent's certificate; keeping the current policies", "version", last, "status", he.StatusCode, "err", err)
				failing = true
			} else if !failing {
				log.Warn("policy server unreachable; keeping the current policies", "version", last, "err", err)
				failing = true
			} else {
				log.Debug("policy server still unreachable", "err", err, "backoff", backoff)
			}
			sleepBackoff(ctx, &backoff)
			continue
		}
		status(true, nil)
		if failing {
			log.Info("policy server reachable again")
			failing = false
		}
		backoff = minBackoff
		if set.Version < last && !warnedOlder {
			log.Warn("the policy server's version is older than ours (was its database replaced?); keeping ours until it passes it",
				"server_version", set.Version, "version", last)
			warnedOlder = true
		}
		if set.Version <= last {
			continue
		}
		warnedOlder = false
		if cfg.CacheFile != "" {
			if err := writeCache(cfg.CacheFile, cfg.Host, set); err != nil {
				log.Error("writing the policy cache failed", "file", cfg.CacheFile, "err", err)
			}
		}
		log.Info("new policies", "version", set.Version, "policies", len(set.Policies), "types", len(set.Types))
		last = set.Version
		update(set)
	}
	return nil
}

func readCache(path, host string) (api.PolicySet, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return api.PolicySet{}, err
	}
	var cf cacheFile
	if err := json.Unmarshal(data, &cf); err != nil {
		return api.PolicySet{}, fmt.Errorf("policy cache %s: %w", path, err)
	}
	if cf.Host != "" && cf.Host != host {
		return api.PolicySet{}, fmt.Errorf("policy cache %s holds the policies of host %q, not %q", path, cf.Host, host)
	}
	return cf.PolicySet, nil
}

func writeCache(path, host string, set api.PolicySet) error {
	data, err := json.MarshalIndent(cacheFile{PolicySet: set, Host: host}, "", "  ")
	if err != nil {
		return err
	}
	return WriteFileAtomic(path, append(data, '\n'), 0o644)
}

// ReadCache returns the policy set an agent cached for host, so that the
// agent can enforce it before anything else on start (Watch delivers it
// again, which changes nothing).
func ReadCache(path, host string) (api.PolicySet, error) { return readCache(path, host) }

// agentLogger is the logger of an agent's exchanges with the server: l (or
// the default logger) with the server's URL and the agent's name.
func agentLogger(l *slog.Logger, url, host string) *slog.Logger {
	if l == nil {
		l = slog.Default()
	}
	return l.With("server", url, "host", host)
}

// WriteFileAtomic writes data to path through a temporary file in the same
// directory and a rename, so that readers see the old content or the new,
// never a part. The policy server writes its ready file with it.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after the rename
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	// Make the rename itself durable; a failure here loses nothing but
	// durability, so it is not reported.
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}
