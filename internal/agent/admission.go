package agent

import (
	"fmt"

	"github.com/dysco/dysco/internal/wire"
)

// setAdmission tells the datapath which Dysco SYNs it admits (paper §2.3
// "Security"; bpf/include/admit.h): with a deployment key, SYNs whose MAC
// verifies under the key derived from it, and SYNs from the --trusted
// prefixes; without one, SYNs from the --trusted prefixes only. An agent
// with neither admits no Dysco SYN: it still starts chains, but cannot be a
// middlebox or the destination of one, and says so.
func (a *Agent) setAdmission() error {
	var key *wire.MACKey
	if len(a.cfg.ControlKey) > 0 {
		k, err := SynMACKey(a.cfg.ControlKey)
		if err != nil {
			return err
		}
		key = &k
	}
	if err := a.dp.SetSynKeys(key, nil); err != nil {
		return err
	}
	if err := a.dp.SetTrusted(a.cfg.Trusted); err != nil {
		return fmt.Errorf("agent: --trusted: %w", err)
	}
	if key == nil && len(a.cfg.Trusted) == 0 {
		a.log.Warn("Dysco SYNs from other hosts are refused (counted as drop_untrusted): no deployment key (--control-key-file) " +
			"and no --trusted prefixes; this host can start chains but cannot be a middlebox or the destination of one")
	}
	return nil
}

// admission describes the admission of Dysco SYNs at this agent, for its
// status.
func (a *Agent) admission() string {
	switch keyed, n := len(a.cfg.ControlKey) > 0, len(a.cfg.Trusted); {
	case keyed && n > 0:
		return fmt.Sprintf("MAC or trusted source (%d prefixes)", n)
	case keyed:
		return "MAC (deployment key)"
	case n > 0:
		return fmt.Sprintf("trusted sources only (%d prefixes)", n)
	}
	return "none (no deployment key, no trusted prefixes): Dysco SYNs from other hosts are refused"
}
