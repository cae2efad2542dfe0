// Package protocol is the Dysco reconfiguration protocol (paper §3) as a
// pure, deterministic state machine.
//
// An Agent is the protocol half of one Dysco agent (one host or network
// namespace). It has no sockets, clocks, goroutines or randomness: the
// caller hands it events (a control message received, a report from the
// datapath, a timer firing, an operator request), each stamped with the
// current time, and carries out the actions it returns (messages to send,
// datapath updates, timers to set or cancel, results to report). The agent
// wires it to UDP and to the eBPF maps; package sim wires it to a simulated
// network; the Promela model mirrors its states and messages, whose names
// follow the paper: unlocked / lockPending / locked, requestor,
// requestLock / ackLock / nackLock, cancelLock / ackCancel, rightDelta /
// leftDelta, oldSent / oldRcvd / oldSentAcked / oldRcvdAcked / firstNewRcvd.
//
// The per-packet rules of the two-path phase (§3.5) are pure functions of a
// packet summary and the anchor's variables (Decide, Observe) so that the
// datapath can implement the same tables and be tested against the shared
// vectors in testdata/twopath_vectors.json. A UDP session (SessionUp.Proto)
// has no sequence numbers: its two-path phase is a switch per anchor and a
// drain of the old path (udp.go).
//
// docs/protocol.md describes the state machines, the message format and what
// the datapath must do for each action.
package protocol
