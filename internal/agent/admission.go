package agent

import (
	"fmt"

	"github.com/dysco/dysco/internal/keys"
	"github.com/dysco/dysco/internal/wire"
)

// setAdmission tells the datapath which Dysco SYNs it admits (paper §2.3
// "Security"; bpf/include/admit.h): with a deployment key, SYNs whose MAC
// verifies under a key derived from it, and SYNs from the --trusted
// prefixes; without one, SYNs from the --trusted prefixes only. An agent
// with neither admits no Dysco SYN: it still starts chains, but cannot be a
// middlebox or the destination of one, and says so.
func (a *Agent) setAdmission() error {
	var ring *keys.Ring
	if a.keys != nil {
		ring = a.keys.Ring()
	}
	if err := a.setSynKeys(ring); err != nil {
		return err
	}
	if err := a.dp.SetTrusted(a.cfg.Trusted); err != nil {
		return fmt.Errorf("agent: --trusted: %w", err)
	}
	if ring == nil && len(a.cfg.Trusted) == 0 {
		a.log.Warn("Dysco SYNs from other hosts are refused (counted as drop_untrusted): no deployment key (--control-key-file) " +
			"and no --trusted prefixes; this host can start chains but cannot be a middlebox or the destination of one")
	}
	return nil
}

// setSynKeys puts the SYN MAC keys of ring into the datapath's two slots:
// the key of the file's first secret signs and verifies, the second's
// verifies too (the step of a rotation where hosts change the secret they
// sign with, docs/operating.md "Control keys"). The datapath has two slots:
// a third secret and those after it admit no SYN, and the agent says so.
func (a *Agent) setSynKeys(ring *keys.Ring) error {
	var cur, prev *wire.MACKey
	if ring != nil {
		ks := ring.Derive(keys.PurposeSYN)
		cur = synKey(ks[0])
		if len(ks) > 1 {
			prev = synKey(ks[1])
		}
		if len(ks) > 2 {
			a.log.Warn("the control key file holds more than two secrets: Dysco SYNs are signed under the first and admitted under the first two only",
				"secrets", len(ks))
		}
	}
	return a.dp.SetSynKeys(cur, prev)
}

// admission describes the admission of Dysco SYNs at this agent, for its
// status.
func (a *Agent) admission() string {
	switch keyed, n := a.keys != nil, len(a.cfg.Trusted); {
	case keyed && n > 0:
		return fmt.Sprintf("MAC or trusted source (%d prefixes)", n)
	case keyed:
		return "MAC (deployment key)"
	case n > 0:
		return fmt.Sprintf("trusted sources only (%d prefixes)", n)
	}
	return "none (no deployment key, no trusted prefixes): Dysco SYNs from other hosts are refused"
}
