package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/reconfig"
)

// handleSplice is the local API's POST /v1/splice: a proxy hands two of
// its sockets to each other (internal/reconfig, Shell.Splice).
func (a *Agent) handleSplice(w http.ResponseWriter, r *http.Request) {
	if a.ctl == nil {
		writeErr(w, 503, errNoControl)
		return
	}
	var req api.SpliceRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		writeErr(w, 400, fmt.Errorf("splice: bad JSON: %w", err))
		return
	}
	for _, sp := range []api.SocketPair{req.In, req.Out} {
		if !sp.Local.IsValid() || !sp.Remote.IsValid() {
			writeErr(w, 400, errors.New("splice: both sockets need local and remote addresses"))
			return
		}
	}
	var rep api.SpliceReply
	at := time.Now()
	id, ch, err := a.ctl.Splice(req)
	rep.ID = id
	if err != nil {
		code := 409
		var be reconfig.BadSpliceError
		if errors.As(err, &be) {
			code = 400
		}
		a.log.Warn("proxy splice refused", "in", req.In.Remote.String()+"->"+req.In.Local.String(),
			"out", req.Out.Local.String()+"->"+req.Out.Remote.String(), "err", err)
		writeErr(w, code, err)
		return
	}
	a.log.Info("proxy splice: removal requested", "in", req.In.Remote.String()+"->"+req.In.Local.String(),
		"out", req.Out.Local.String()+"->"+req.Out.Remote.String(), "delta", req.Delta, "delta_rev", req.DeltaRev)
	if req.Wait {
		ctx, cancel := context.WithTimeout(r.Context(), defaultReconfigWait)
		defer cancel()
		res := api.ReconfigResult{ID: rep.ID}
		select {
		case m := <-ch:
			res.Outcome, res.Reason, res.Blocker = m.Outcome, m.Reason, m.Blocker
			res.Micros = time.Since(at).Microseconds()
		case <-ctx.Done():
			res.Outcome, res.Reason = "failed", "no result before the deadline"
		}
		rep.Result = &res
	} else {
		go func() {
			m := <-ch
			a.log.Info("proxy removal", "session", rep.ID, "outcome", m.Outcome, "reason", m.Reason)
		}()
	}
	writeJSON(w, 200, rep)
}
