package psclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// OpsConfig configures ServeOperations.
type OpsConfig struct {
	// URL is the policy server, Host the agent's name, TLS its client
	// configuration (as for Watch).
	URL, Host string
	TLS       *tls.Config
	// Exec carries out an operation and returns the agent's result; ctx
	// ends when ServeOperations' context does.
	Exec func(ctx context.Context, op api.Operation) api.OperationResult
	// Wait is how long each claim poll waits (DefaultWait when zero).
	Wait time.Duration
	// Parallel bounds the operations carried out at once (8 when zero).
	Parallel int
	// Logger receives structured logs (slog.Default() when nil).
	Logger *slog.Logger
}

// ServeOperations is the agent's side of the operator verbs relayed by the
// policy server (internal/policyserver, operations.go): until ctx is done it long-polls for the
// operations named for cfg.Host, carries each out with cfg.Exec (up to
// cfg.Parallel at once) and reports the result, retrying the report until
// the server takes it, refuses it for good, or the operation's own bounds
// have passed. While the server is unreachable it backs off as Watch does.
func ServeOperations(ctx context.Context, cfg OpsConfig) error {
	if cfg.URL == "" || cfg.Host == "" || cfg.Exec == nil {
		return errors.New("policy server operations: URL, host and Exec are required")
	}
	log := agentLogger(cfg.Logger, cfg.URL, cfg.Host)
	wait := pollWait(cfg.Wait)
	par := cfg.Parallel
	if par <= 0 {
		par = 8
	}
	c := api.NewServerClientTLS(cfg.URL, cfg.TLS)
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	defer wg.Wait()
	backoff := minBackoff
	for ctx.Err() == nil {
		// A free slot before claiming: a claimed operation starts at once.
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		op, ok, err := c.ClaimOperation(ctx, cfg.Host, wait)
		if err != nil || !ok {
			<-sem
			if ctx.Err() != nil {
				return nil
			}
			if err != nil {
				// Watch logs the server's reachability; here only the detail.
				log.Debug("claiming operations failed", "err", err, "backoff", backoff)
				sleepBackoff(ctx, &backoff)
				continue
			}
			backoff = minBackoff
			continue
		}
		backoff = minBackoff
		log.Info("operation from the policy server", "id", op.ID, "kind", OpKind(&op))
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			res := cfg.Exec(ctx, op)
			res.Host = cfg.Host
			report(ctx, c, log, op, res)
		}()
	}
	return nil
}

// report gives the server an operation's result, retrying while it is
// unreachable or answers 503 (its store has no quorum), until the operation's own deadline at the server has passed.
// A reply the server refuses (too large, or malformed to it) is replaced by
// an error saying so, so that the operator learns it at once. When ctx has
// ended (the agent stops), one last attempt is made on a short detached
// context: the operator should hear now, not at the deadline.
func report(ctx context.Context, c *api.Client, log *slog.Logger, op api.Operation, res api.OperationResult) {
	give := time.Now().Add(OpTimeout(&op) + ReportSlack)
	backoff := minBackoff
	for {
		rctx, cancel := ctx, context.CancelFunc(func() {})
		if ctx.Err() != nil {
			rctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		}
		err := c.ReportOperation(rctx, op.ID, res)
		cancel()
		if err == nil {
			log.Info("operation reported", "id", op.ID, "err", res.Error)
			return
		}
		var he *api.HTTPError
		if errors.As(err, &he) && res.Error == "" && (he.StatusCode == http.StatusBadRequest || he.StatusCode == http.StatusRequestEntityTooLarge) {
			log.Warn("the policy server refused the operation's reply; reporting the refusal instead", "id", op.ID, "err", err)
			if res.Reply != nil && op.Query == nil {
				res = api.OperationResult{Host: res.Host, Error: fmt.Sprintf("carried out on %d session(s), but the policy server refused the reply (%s); `dysco reconfig history` on the left anchors has the results", len(res.Reply.Results), he.Message)}
			} else {
				res = api.OperationResult{Host: res.Host, Error: fmt.Sprintf("the policy server refused the answer (%s); ask for fewer (--limit), or ask the agent on its host", he.Message)}
			}
			continue
		}
		if (errors.As(err, &he) && he.StatusCode != http.StatusServiceUnavailable) || ctx.Err() != nil || time.Now().After(give) {
			log.Warn("operation result not taken by the policy server", "id", op.ID, "err", err)
			return
		}
		if !sleepBackoff(ctx, &backoff) {
			continue // one last attempt, detached
		}
	}
}

// Bounds of an operation the agent has claimed, the server's and the
// agent's alike: the server declares the operation lost, and the agent
// stops reporting it, ReportSlack after its own timeout.
const (
	// DefaultOpTimeout is the agent's wait for results when the request
	// gives none (agent.defaultReconfigWait).
	DefaultOpTimeout = 10 * time.Second
	// MaxOpTimeout is the most an agent waits (agent.maxReconfigWait).
	MaxOpTimeout = 5 * time.Minute
	// ReportSlack is how much longer than its own timeout a claimed
	// operation may take before it is declared lost.
	ReportSlack = 30 * time.Second
)

// OpTimeout is the time an agent may take over a claimed operation: its own
// timeout, within MaxOpTimeout, or DefaultOpTimeout.
func OpTimeout(op *api.Operation) time.Duration {
	if ms := op.TimeoutMS(); ms > 0 {
		return min(time.Duration(ms)*time.Millisecond, MaxOpTimeout)
	}
	return DefaultOpTimeout
}

// OpKind names an operation's verb for logs: "reconfig", "middlebox" or
// "query".
func OpKind(op *api.Operation) string {
	switch {
	case op.Reconfig != nil:
		return "reconfig"
	case op.Query != nil:
		return "query"
	}
	return "middlebox"
}
