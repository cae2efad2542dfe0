package bench

// The summary of a disruption run: goodput, congestion window and
// retransmissions before the reconfiguration and in the window after it.

import (
	"encoding/json"
	"math"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// disruptionSummary compares the second before the reconfiguration with
// the reconfiguration and the second after it. NaN: no bin in a window.
type disruptionSummary struct {
	// BeforeGbps is the goodput over the bins that ended in the second
	// before the reconfiguration started; BeforeMinGbps its smallest bin
	// (the noise of the steady state).
	BeforeGbps    float64 `json:"before_gbps"`
	BeforeMinGbps float64 `json:"before_min_bin_gbps"`
	BeforeBins    int     `json:"before_bins"`
	// AfterMinGbps is the smallest bin among those that ended after the
	// reconfiguration started and at most 1 s after it ended, at
	// AfterMinAt; AfterGbps the goodput over those bins.
	AfterGbps    float64 `json:"after_gbps"`
	AfterMinGbps float64 `json:"after_min_bin_gbps"`
	AfterMinAt   float64 `json:"after_min_bin_t"`
	AfterBins    int     `json:"after_bins"`
	// Ratio is AfterMinGbps / BeforeGbps, BeforeRatio BeforeMinGbps /
	// BeforeGbps (the same figure for the steady state).
	Ratio       float64 `json:"ratio"`
	BeforeRatio float64 `json:"before_ratio"`
	// Retransmissions in the second before and in the reconfiguration
	// window (from the last bin before it to the last bin of it).
	RetransBefore uint32 `json:"retrans_before"`
	RetransWindow uint32 `json:"retrans_window"`
	// Congestion window (segments): mean and smallest over the second
	// before, smallest and mean over the window, and at the end of the
	// window.
	CwndBefore    float64 `json:"cwnd_before"`
	CwndBeforeMin uint32  `json:"cwnd_before_min"`
	CwndAfterMin  uint32  `json:"cwnd_after_min"`
	CwndAfterMean float64 `json:"cwnd_after_mean"`
	CwndAfterEnd  uint32  `json:"cwnd_after_end"`
	// Out-of-order packets at the receiver, reordering events and
	// duplicate SACKs at the sender, during the second before and during
	// the window.
	RcvOooBefore    uint32 `json:"rcv_ooopack_before"`
	DsackBefore     uint32 `json:"dsack_dups_before"`
	RcvOooWindow    uint32 `json:"rcv_ooopack_window"`
	ReordSeenWindow uint32 `json:"reord_seen_window"`
	DsackWindow     uint32 `json:"dsack_dups_window"`
	// StallBins counts the bins of the window in which nothing arrived.
	StallBins int `json:"stall_bins"`
	// The sender's smoothed RTT (tcpi_rtt, ms): mean over the second
	// before (the old path), largest in the window, mean over the last
	// second of the sampling (the new path).
	RttBeforeMs    float64 `json:"rtt_before_ms"`
	RttWindowMaxMs float64 `json:"rtt_window_max_ms"`
	RttLastMs      float64 `json:"rtt_last_ms"`
	// LastGbps is the goodput over the bins of the last second of the
	// sampling that end after the window (the new path), LastBins their
	// number.
	LastGbps float64 `json:"last_gbps"`
	LastBins int     `json:"last_bins"`
	// In the window: bins in which the sender was in recovery or loss
	// (ca_state ≥ 3), retransmission timeouts, and the most segments the
	// sender had marked lost and SACKed at a sample.
	RecoveryBins  int    `json:"recovery_bins"`
	RtoWindow     uint32 `json:"rtos_window"`
	LostWindowMax uint32 `json:"lost_window_max"`
	SackedMax     uint32 `json:"sacked_window_max"`
	// RecoveryBinsBefore is the same count over the second before.
	RecoveryBinsBefore int `json:"recovery_bins_before"`
	// The sender's reordering degree (tcpi_reordering: how many segments
	// may overtake one before it counts as lost) at the last bin before
	// the reconfiguration and at the end of the window.
	ReorderingBefore uint32 `json:"reordering_before"`
	ReorderingAfter  uint32 `json:"reordering_after"`
}

// MarshalJSON writes NaN as null.
func (s disruptionSummary) MarshalJSON() ([]byte, error) {
	type plain disruptionSummary
	num := labkit.JSONNum
	return json.Marshal(struct {
		plain
		BeforeGbps    *float64 `json:"before_gbps"`
		BeforeMinGbps *float64 `json:"before_min_bin_gbps"`
		AfterGbps     *float64 `json:"after_gbps"`
		AfterMinGbps  *float64 `json:"after_min_bin_gbps"`
		AfterMinAt    *float64 `json:"after_min_bin_t"`
		Ratio         *float64 `json:"ratio"`
		BeforeRatio   *float64 `json:"before_ratio"`
		CwndBefore    *float64 `json:"cwnd_before"`
		CwndAfterMean *float64 `json:"cwnd_after_mean"`
		RttBeforeMs   *float64 `json:"rtt_before_ms"`
		RttLastMs     *float64 `json:"rtt_last_ms"`
		RttWindowMax  *float64 `json:"rtt_window_max_ms"`
		LastGbps      *float64 `json:"last_gbps"`
	}{plain(s), num(s.BeforeGbps), num(s.BeforeMinGbps), num(s.AfterGbps), num(s.AfterMinGbps), num(s.AfterMinAt),
		num(s.Ratio), num(s.BeforeRatio), num(s.CwndBefore), num(s.CwndAfterMean), num(s.RttBeforeMs), num(s.RttLastMs), num(s.RttWindowMaxMs), num(s.LastGbps)})
}

// summarizeDisruption computes the summary of samples for a
// reconfiguration from start to end (seconds, the samples' time base):
// the "before" bins end in (start-win, start], the "after" bins in (start,
// end+win], the "last" bins in the last win of the samples, after
// end+win.
func summarizeDisruption(samples []DisruptionSample, start, end float64, win time.Duration) disruptionSummary {
	w := win.Seconds()
	nan := math.NaN()
	s := disruptionSummary{BeforeGbps: nan, BeforeMinGbps: nan, AfterGbps: nan, AfterMinGbps: nan, AfterMinAt: nan,
		Ratio: nan, BeforeRatio: nan, CwndBefore: nan, CwndAfterMean: nan, RttBeforeMs: nan, RttWindowMaxMs: nan, RttLastMs: nan, LastGbps: nan}
	lastT := 0.0
	if len(samples) > 0 {
		lastT = samples[len(samples)-1].T
	}
	var bRtt, lRtt, lSec float64
	var lBytes uint64
	// lastBefore is the last bin that ended before the window of "before"
	// (the base of its counters), lastIn the last bin of "before".
	var firstBefore, lastBefore, lastAfter = -1, -1, -1
	var bBytes, aBytes uint64
	var bSec, aSec, bCwnd, aCwnd float64
	prevT := 0.0
	for i, x := range samples {
		dt := x.T - prevT
		prevT = x.T
		switch {
		case x.T > start-w && x.T <= start:
			if firstBefore < 0 {
				firstBefore = i
			}
			lastBefore = i
			if s.BeforeBins == 0 || x.Cwnd < s.CwndBeforeMin {
				s.CwndBeforeMin = x.Cwnd
			}
			s.BeforeBins++
			bBytes += x.Bytes
			bSec += dt
			bCwnd += float64(x.Cwnd)
			bRtt += float64(x.RttUs) / 1000
			if x.CaState >= 3 {
				s.RecoveryBinsBefore++
			}
			if math.IsNaN(s.BeforeMinGbps) || x.Gbps < s.BeforeMinGbps {
				s.BeforeMinGbps = x.Gbps
			}
		case x.T > start && x.T <= end+w:
			lastAfter = i
			if s.AfterBins == 0 || x.Cwnd < s.CwndAfterMin {
				s.CwndAfterMin = x.Cwnd
			}
			s.AfterBins++
			aBytes += x.Bytes
			aSec += dt
			aCwnd += float64(x.Cwnd)
			if math.IsNaN(s.AfterMinGbps) || x.Gbps < s.AfterMinGbps {
				s.AfterMinGbps, s.AfterMinAt = x.Gbps, x.T
			}
			if x.Bytes == 0 {
				s.StallBins++
			}
			if x.CaState >= 3 {
				s.RecoveryBins++
			}
			if r := float64(x.RttUs) / 1000; math.IsNaN(s.RttWindowMaxMs) || r > s.RttWindowMaxMs {
				s.RttWindowMaxMs = r
			}
			s.LostWindowMax = max(s.LostWindowMax, x.Lost)
			s.SackedMax = max(s.SackedMax, x.Sacked)
		case x.T > end+w && x.T > lastT-w:
			s.LastBins++
			lBytes += x.Bytes
			lSec += dt
			lRtt += float64(x.RttUs) / 1000
		}
	}
	if s.LastBins > 0 && lSec > 0 {
		s.LastGbps = float64(lBytes) * 8 / lSec / 1e9
		s.RttLastMs = lRtt / float64(s.LastBins)
	}
	if s.BeforeBins > 0 && bSec > 0 {
		s.BeforeGbps = float64(bBytes) * 8 / bSec / 1e9
		s.CwndBefore = bCwnd / float64(s.BeforeBins)
		s.RttBeforeMs = bRtt / float64(s.BeforeBins)
		s.BeforeRatio = labkit.Ratio(s.BeforeMinGbps, s.BeforeGbps)
		base := samples[lastBefore]
		var b0 DisruptionSample // counters start at zero
		if firstBefore > 0 {
			b0 = samples[firstBefore-1]
		}
		s.RetransBefore = base.Retrans - b0.Retrans
		s.RcvOooBefore = base.RcvOoo - b0.RcvOoo
		s.ReorderingBefore = base.Reordering
		s.DsackBefore = base.DsackDups - b0.DsackDups
	}
	if s.AfterBins > 0 && aSec > 0 {
		s.AfterGbps = float64(aBytes) * 8 / aSec / 1e9
		s.CwndAfterMean = aCwnd / float64(s.AfterBins)
		a := samples[lastAfter]
		s.CwndAfterEnd = a.Cwnd
		s.ReorderingAfter = a.Reordering
		var base DisruptionSample
		if lastBefore >= 0 {
			base = samples[lastBefore]
		} else if i := lastAfter - s.AfterBins; i >= 0 {
			base = samples[i]
		}
		s.RetransWindow = a.Retrans - base.Retrans
		s.RcvOooWindow = a.RcvOoo - base.RcvOoo
		s.ReordSeenWindow = a.ReordSeen - base.ReordSeen
		s.DsackWindow = a.DsackDups - base.DsackDups
		s.RtoWindow = a.Rtos - base.Rtos
	}
	if !math.IsNaN(s.BeforeGbps) && !math.IsNaN(s.AfterMinGbps) {
		s.Ratio = labkit.Ratio(s.AfterMinGbps, s.BeforeGbps)
	}
	return s
}
