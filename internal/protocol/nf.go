package protocol

import (
	"errors"
	"net/netip"
	"slices"
	"time"
)

// Network functions on demand (heterogeneous-sfc-quic §IV): "Agents
// running on processor-based middleboxes can adjust (reconfigure)
// middlebox functionality by starting/terminating VNF processes. The need
// for a specific VNF can be included in the control packet during service
// chain modification. The agent triggers the [...] reconfiguration of
// middlebox functionality before forwarding the control packet to the next
// middlebox. The session on the service chain continues to operate during
// reconfiguration, as session data is still transmitted on the old path."
//
// A request may name the network function each middlebox of its new chain
// must run (Reconfigure.NFs); the new path's SYN carries them (NFBody). A
// middlebox whose SYN names a function for it does not join at once: it
// asks its agent to start the function (StartNF), answers the SYN and its
// retransmissions with a synAck saying that the function starts (the left
// anchor keeps waiting: onNFStarting), and joins and passes the SYN on
// once the agent reports it ready (NFStarted). If the agent cannot start
// it, the host refuses the new path (ReasonNF, with the agent's reason),
// and the left anchor cancels the request (§3.6): the session stays on its
// old path. The core starts nothing itself: the agent does, aside, and
// reports back.

// nfJoin is a new path waiting at this host for its network function.
type nfJoin struct {
	from netip.Addr
	m    *Message
	name string
	at   time.Duration
	// failed: the function could not be started; text says why. Kept (a
	// lease) to answer the SYN's retransmissions with the same refusal.
	failed bool
	text   string
}

// maxNFJoins bounds Agent.nfJoins.
const maxNFJoins = 1024

// checkNFs reports whether nfs fits chain (Reconfigure.NFs): none, or one
// per hop, each empty or a valid name.
func checkNFs(chain []netip.Addr, nfs []string) bool {
	if len(nfs) == 0 {
		return true
	}
	return len(nfs) == len(chain) && !slices.ContainsFunc(nfs, func(n string) bool { return n != "" && !ValidNFName(n) })
}

// CheckNFs is checkNFs with an error for the operator.
func CheckNFs(chain []netip.Addr, nfs []string) error {
	if !checkNFs(chain, nfs) {
		return errors.New("network functions: one per hop of the chain, each empty or a name of letters, digits, '_' and '-' (a letter first, at most 32)")
	}
	return nil
}

// selfNF is the network function a syn names for its receiver ("": none).
func (m *Message) selfNF() string {
	if m.NF == nil || len(m.NF.Names) == 0 {
		return ""
	}
	return m.NF.Names[0]
}

// onNFSyn handles a new path's SYN that names a network function for this
// host: the first asks the agent to start it; a retransmission while it
// starts is answered "starting", one after it failed with the refusal.
func (a *Agent) onNFSyn(from netip.Addr, m *Message, name string) {
	j := a.nfJoins[m.Req]
	switch {
	case j == nil:
		if len(a.nfJoins) >= maxNFJoins {
			for k, x := range a.nfJoins {
				if a.now-x.at >= a.cfg.LockLease {
					delete(a.nfJoins, k)
				}
			}
			if len(a.nfJoins) >= maxNFJoins {
				a.reject(RejectUnexpected, m, from, "syn for %s: %d new paths wait for network functions here already", m.Req, len(a.nfJoins))
				return
			}
		}
		a.nfJoins[m.Req] = &nfJoin{from: from, m: m, name: name, at: a.now}
		a.emit(StartNF{Req: m.Req, Name: name, Session: m.Session})
		a.emit(Progress{Req: m.Req, Role: RoleNewHop, Stage: StageSettingUp, Note: "starting network function " + name, NF: name})
		a.sendNFStarting(from, m, name)
	case j.name != name || j.m.Nonce != m.Nonce || j.m.Session != m.Session:
		a.reject(RejectUnexpected, m, from, "syn for %s: names another function or session than the one waiting here", m.Req)
	case j.failed:
		a.refuseNF(from, m, name, j.text)
	default:
		// The latest copy is the one to join: a host before this one
		// that left on a lost refusal and joined again comes with a new
		// subsession.
		j.from, j.m = from, m
		a.sendNFStarting(from, m, name)
	}
}

// onNFStarted: the agent's answer to StartNF. Ready: join the new path
// and pass the SYN on (§IV: the function is in place before the control
// packet goes on). Not: refuse the new path.
func (a *Agent) onNFStarted(e NFStarted) {
	j := a.nfJoins[e.Req]
	if j == nil || j.failed || j.name != e.Name {
		return
	}
	if e.Err == "" {
		delete(a.nfJoins, e.Req)
		if _, used := a.subs[j.m.Sub]; used {
			return // cannot happen: the subsession was unknown and nothing joins it meanwhile
		}
		a.joinNewPath(j.from, j.m, j.name)
		return
	}
	j.failed, j.text, j.at = true, clip(e.Err, MaxNFText), a.now
	a.emit(Progress{Req: e.Req, Role: RoleNewHop, Stage: StageDone, Note: "refused: network function " + j.name + ": " + j.text, NF: j.name, NFDone: true})
	a.refuseNF(j.from, j.m, j.name, j.text)
}

// sendNFStarting tells the host before this one on the new path that this
// host starts its network function: a synAck carrying the name, no flag.
// It goes back to the left anchor, which keeps waiting.
func (a *Agent) sendNFStarting(from netip.Addr, m *Message, name string) {
	a.send(from, &Message{Type: MsgSynAck, Nonce: m.Nonce, Sub: m.Sub, Session: m.Session, Req: m.Req,
		RightAnchor: m.RightAnchor, NF: &NFBody{Names: []string{name}}})
}

// refuseNF refuses the new path: its network function could not be started.
func (a *Agent) refuseNF(from netip.Addr, m *Message, name, text string) {
	a.send(from, &Message{Type: MsgSynAck, Flags: FlagRefuse, Reason: ReasonNF, Nonce: m.Nonce, Sub: m.Sub,
		Session: m.Session, Req: m.Req, RightAnchor: m.RightAnchor, Hops: []netip.Addr{a.cfg.Self},
		NF: &NFBody{Names: []string{name}, Text: text}})
}

// onNFStarting (left anchor): a host of the new path starts its network
// function. The new path is on its way: the SYN's retransmissions go on
// (each answered the same while it starts), counted afresh, so that a
// start longer than the SYN's tries does not cancel the request; the host
// refuses the path itself if its start fails or times out, and a host
// that stops answering runs the tries out as before. The wait is bounded
// all the same, by half the lock lease (the old path's agents hold their
// locks meanwhile): after it the tries run out.
func (a *Agent) onNFStarting(s *session, l *anchor, m *Message) {
	if l.stage != StageSettingUp || l.gated {
		return
	}
	if l.nfWait == "" {
		l.nfSince = a.now
	}
	if a.now-l.nfSince < a.cfg.LockLease/2 {
		l.tries = 1
	}
	if l.nfWait == "" {
		l.nfWait = m.NF.Names[0]
		a.emit(Progress{Session: s.id, Req: l.req, Role: RoleLeftAnchor, Stage: StageSettingUp,
			Note: "waiting for network function " + l.nfWait + " to start", NF: l.nfWait})
	}
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
