package reconfig

// Triggers: a middlebox host asks the left neighbour of one of its sessions
// to reconfigure the segment around it (paper §2.3: "a middlebox can ask to
// be removed"; §4.2: a proxy removes itself). The reconfiguration protocol
// proper starts at the left anchor (§3.1); a trigger only asks for it, and
// the answer comes back when the left anchor's request ends.
//
// Wire format (UDP, same port as the protocol): "DYST", version 1, kind
// (1 request, 2 result), then a JSON body, then HMAC-SHA256 (16 bytes) of
// everything before it under the deployment key. Requests carry their send
// time and are refused when older than triggerMaxAge, and a request token
// is answered once (retransmissions get the same answer).

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/datapath"
	"github.com/dysco/dysco/internal/protocol"
	"github.com/dysco/dysco/internal/wire"
)

const (
	triggerMagic   = "DYST"
	triggerVersion = 1
	triggerRequest = 1
	triggerResult  = 2
	triggerMaxAge  = 30 * time.Second
)

// triggerMsg is a trigger request or its result.
type triggerMsg struct {
	Token uint64 `json:"token"`
	// Request: the subsession from the left neighbour to the sender (as its
	// SYN went), the right anchor and the new chain.
	Sub         *wire.Tuple  `json:"sub,omitempty"`
	RightAnchor netip.Addr   `json:"right_anchor,omitzero"`
	Chain       []netip.Addr `json:"chain,omitempty"`
	SentUnixMS  int64        `json:"sent_unix_ms,omitempty"`
	// Migrate asks for state migration (migrate.go).
	Migrate *api.MigrateSpec `json:"migrate,omitempty"`
	// Result.
	Outcome string `json:"outcome,omitempty"`
	Reason  string `json:"reason,omitempty"`
	Blocker string `json:"blocker,omitempty"`
	Micros  int64  `json:"micros,omitempty"`
	// Migration reports a state migration.
	Migration *api.MigrationReport `json:"migration,omitempty"`
}

// trigger is a request this agent sent, waiting for its result.
type trigger struct {
	to    netip.Addr
	data  []byte
	ch    chan triggerMsg
	tries int
	timer *time.Timer
	// splice is the client session of the proxy's joined sessions this
	// trigger asks to remove (0: none): their record notes the answer.
	splice uint32
}

var errTriggerMAC = errors.New("trigger MAC mismatch")

func isTrigger(b []byte) bool { return len(b) >= 6 && string(b[:4]) == triggerMagic }

func encodeTrigger(key []byte, kind byte, m triggerMsg) ([]byte, error) {
	return sealJSON(key, triggerMagic, triggerVersion, kind, m)
}

func decodeTrigger(key, b []byte) (byte, triggerMsg, error) {
	var m triggerMsg
	kind, err := openJSON(key, b, triggerVersion, &m)
	if errors.Is(err, errSealMAC) {
		err = errTriggerMAC
	}
	return kind, m, err
}

// sealJSON frames the agent-level control messages (triggers, migration):
// magic (4 bytes), version, kind, a JSON body, then HMAC-SHA256 (16 bytes)
// of everything before it under the deployment key.
func sealJSON(key []byte, magic string, version, kind byte, v any) ([]byte, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	b := append([]byte(magic), version, kind)
	b = append(b, body...)
	h := hmac.New(sha256.New, key)
	h.Write(b)
	return append(b, h.Sum(nil)[:sealMACLen]...), nil
}

const sealMACLen = 16

var errSealMAC = errors.New("MAC mismatch")

// openJSON checks a sealJSON frame and decodes its body into v; it returns
// the kind.
func openJSON(key, b []byte, version byte, v any) (byte, error) {
	if len(b) < 6+sealMACLen {
		return 0, errors.New("message too short")
	}
	if b[4] != version {
		return 0, fmt.Errorf("message version %d", b[4])
	}
	body, tag := b[:len(b)-sealMACLen], b[len(b)-sealMACLen:]
	h := hmac.New(sha256.New, key)
	h.Write(body)
	if !hmac.Equal(h.Sum(nil)[:sealMACLen], tag) {
		return 0, errSealMAC
	}
	if err := json.Unmarshal(body[6:], v); err != nil {
		return 0, fmt.Errorf("message body: %v", err)
	}
	return b[5], nil
}

// answered remembers the results of trigger requests, by sender and token.
type triggerKey struct {
	from  netip.Addr
	token uint64
}

// onTrigger handles a trigger request or result (loop goroutine).
func (c *Shell) onTrigger(from netip.Addr, data []byte) {
	kind, m, err := decodeTrigger(c.key, data)
	if err != nil {
		reason := "trigger_malformed"
		if errors.Is(err, errTriggerMAC) {
			reason = "trigger_bad_mac"
		}
		c.countReject(reason)
		c.log.Debug("trigger refused", "from", from, "err", err)
		return
	}
	switch kind {
	case triggerResult:
		t := c.triggers[m.Token]
		if t == nil || t.to != from {
			c.countReject("trigger_unexpected")
			return
		}
		delete(c.triggers, m.Token)
		t.timer.Stop()
		if t.splice != 0 {
			// Answered, whatever the outcome: a restarted agent does
			// not ask again (resumeSplice).
			if err := c.dp.SpliceAnswered(t.splice); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				c.log.Warn("proxy removal: cannot note the left anchor's answer", "session", t.splice, "err", err)
			}
		}
		t.ch <- m
	case triggerRequest:
		k := triggerKey{from, m.Token}
		if res, ok := c.trigAnswers[k]; ok {
			if res != nil {
				c.send(from, res)
			}
			return // a retransmission: answered, or still running
		}
		age := time.Since(time.UnixMilli(m.SentUnixMS))
		if m.Sub == nil || age > triggerMaxAge || age < -triggerMaxAge {
			c.countReject("trigger_stale")
			return
		}
		answer := func(r triggerMsg) {
			r.Token = m.Token
			b, err := encodeTrigger(c.key, triggerResult, r)
			if err != nil {
				return
			}
			c.trigAnswers[k] = b
			time.AfterFunc(2*triggerMaxAge, func() { c.post(func() { delete(c.trigAnswers, k) }) })
			c.send(from, b)
		}
		// The sender must be the right end of the subsession it names.
		if m.Sub.Dst != from {
			answer(triggerMsg{Outcome: "refused", Reason: "the subsession does not lead to the sender"})
			return
		}
		id, ok := c.sessionBySub(*m.Sub)
		if !ok {
			answer(triggerMsg{Outcome: "refused", Reason: protocol.ReasonNoSession.String()})
			return
		}
		// The sender must be the session's next hop now: a middlebox
		// that a reconfiguration has already taken out of the path
		// (its old subsession lingers here) must not reconfigure the
		// segment that replaced it. While that side is in a
		// reconfiguration itself (its record not back to TPNew), the
		// protocol answers busy, which the sender may retry; currentSub
		// would name the wrong path then.
		if sess, ok := c.dp.Session(id); ok && c.sideSettled(id, protocol.SideRight) {
			if cur, ok := c.currentSub(id, &sess, protocol.SideRight); !ok || cur != *m.Sub {
				answer(triggerMsg{Outcome: "refused", Reason: "the sender is no longer this session's next hop (its path changed)"})
				return
			}
		}
		mig, err := ParseMigrate(m.Migrate, len(m.Chain))
		if err != nil {
			answer(triggerMsg{Outcome: "refused", Reason: err.Error()})
			return
		}
		c.trigAnswers[k] = nil
		start := time.Now()
		if err := c.announce(id); err != nil {
			answer(triggerMsg{Outcome: "refused", Reason: err.Error()})
			return
		}
		if err := c.sameFamily(id, m.RightAnchor); err != nil {
			answer(triggerMsg{Outcome: "refused", Reason: err.Error()})
			return
		}
		c.token++
		ch := make(chan waited, 1)
		c.waiters[c.token] = ch
		c.started[c.token] = start
		var migc chan api.MigrationReport
		if mig != nil {
			migc = make(chan api.MigrationReport, 1)
			c.startMigration(c.token, *mig, start, migc)
		}
		c.handle(c.famOf[id], protocol.Reconfigure{Session: c.pidOf[id], RightAnchor: m.RightAnchor, Chain: m.Chain, Token: c.token, Gate: mig != nil})
		go func() {
			r := (<-ch).res
			var rep *api.MigrationReport
			if migc != nil {
				x := <-migc
				rep = &x
			}
			c.post(func() {
				res := triggerMsg{Outcome: r.Outcome.String(), Reason: reasonText(r), Blocker: blockerText(r),
					Micros: time.Since(start).Microseconds(), Migration: rep}
				if rep != nil && rep.Error != "" {
					res.Reason = joinNote(res.Reason, rep.Error)
				}
				answer(res)
			})
		}()
	default:
		c.countReject("trigger_malformed")
	}
}

// sideSettled tells whether a side of session id is in no reconfiguration
// at this host: it has no two-path record, or its record is back to TPNew.
func (c *Shell) sideSettled(id uint32, side protocol.Side) bool {
	tp, ok := c.dp.TwoPath(datapath.TPKey{SessId: id, Side: uint32(side)})
	return !ok || tp.State == datapath.TPNew
}

// sendTrigger asks from's left neighbour to reconfigure; the result
// arrives on the returned channel. splice is the client session of a
// proxy's joined sessions that the trigger asks to remove, 0 for other
// triggers. Loop goroutine.
func (c *Shell) sendTrigger(to netip.Addr, m triggerMsg, splice uint32) (chan triggerMsg, error) {
	c.token++
	m.Token = c.token
	m.SentUnixMS = time.Now().UnixMilli()
	b, err := encodeTrigger(c.key, triggerRequest, m)
	if err != nil {
		return nil, err
	}
	t := &trigger{to: to, data: b, ch: make(chan triggerMsg, 1), splice: splice}
	c.triggers[m.Token] = t
	token := m.Token
	var send func()
	send = func() {
		t.tries++
		c.send(to, t.data)
		if t.tries >= 10 {
			t.timer = time.AfterFunc(time.Second, func() {
				c.post(func() {
					if c.triggers[token] == t {
						delete(c.triggers, token)
						t.ch <- triggerMsg{Outcome: "failed", Reason: "no answer from the left neighbour " + to.String()}
					}
				})
			})
			return
		}
		t.timer = time.AfterFunc(time.Duration(50<<min(t.tries, 4))*time.Millisecond, func() {
			c.post(func() {
				if c.triggers[token] == t {
					send()
				}
			})
		})
	}
	send()
	return t.ch, nil
}

func reasonText(r protocol.Result) string {
	text := r.Reason.String()
	if r.Reason == protocol.ReasonOnPath && r.Hop.IsValid() {
		text = r.Hop.String() + " is already on the session's path (a middlebox cannot be on the old and the new path at once; to keep it, anchor the request at it)"
	}
	if r.Outcome == protocol.Succeeded {
		text = ""
		if r.Unchanged {
			text = "unchanged: the session already takes this path"
		}
		if r.Unconfirmed {
			text = "old path torn down without confirmation"
		}
	}
	if r.Resumed {
		text = joinNote(text, "resumed after an agent restart")
	}
	return text
}

func blockerText(r protocol.Result) string {
	if r.Blocker.IsZero() {
		return ""
	}
	return r.Blocker.String()
}
