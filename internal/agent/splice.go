package agent

import (
	"errors"
	"net/http"
)

// handleSplice joins a proxy's two sessions and removes the proxy (§2.4,
// §4.2). Not yet implemented: see docs/protocol.md "Integration".
func (a *Agent) handleSplice(w http.ResponseWriter, r *http.Request) {
	writeErr(w, 501, errors.New("splice: proxy removal is not implemented in this agent yet"))
}
