package bench

// The greedy session of a disruption run and its sampling every
// disruptionBin, across the reconfiguration.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// disruptionSession is the session of a run: the runner's sender on the
// client writing as fast as TCP lets, its receiver on the server.
type disruptionSession struct {
	x        *DisruptionRun
	ln       net.Listener
	snd, rcv *net.TCPConn
	stopped  atomic.Bool
	wg       sync.WaitGroup
	errMu    sync.Mutex // x.SessionErrs
	appRx    atomic.Int64
}

// openSession dials the session through mb1 with the congestion control
// of the runs and starts its sender and receiver.
func (dl *DisruptionLab) openSession(ctx context.Context, x *DisruptionRun, port int) (_ *disruptionSession, err error) {
	dst := netip.AddrPortFrom(dl.srv, uint16(port)).String()
	ln, err := dl.lab.Listen("server", "tcp", dst)
	if err != nil {
		return nil, fmt.Errorf("lab %s: listening on the server: %w", dl.lab.Name(), err)
	}
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	sc, err := dialCC(dctx, dl.lab, "client", dst, disruptionCC)
	cancel()
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("lab %s: dialling %s through mb1: %w", dl.lab.Name(), dst, err)
	}
	var rc net.Conn
	select {
	case c, ok := <-accepted:
		if !ok {
			sc.Close()
			ln.Close()
			return nil, errors.New("accepting the session on the server failed")
		}
		rc = c
	case <-time.After(10 * time.Second):
		sc.Close()
		ln.Close()
		return nil, fmt.Errorf("the server did not accept the session to %s in 10 s", dst)
	}
	s := &disruptionSession{x: x, ln: ln, snd: sc.(*net.TCPConn), rcv: rc.(*net.TCPConn)}
	x.Session = fmt.Sprintf("%s -> %s", s.snd.LocalAddr(), s.snd.RemoteAddr())
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	s.wg.Add(2)
	go s.send()
	go s.receive()
	if ti, err := tcpInfo(s.snd); err == nil {
		x.SACKNegotiated = ti.Options&tcpiOptSACK != 0
	}
	if x.CC, err = congestionControl(s.snd); err != nil {
		return nil, fmt.Errorf("reading the sender's congestion control: %w", err)
	}
	if x.CC != disruptionCC {
		return nil, fmt.Errorf("the sender's congestion control is %q, not %q", x.CC, disruptionCC)
	}
	return s, nil
}

// fail records an error of the session's sender or receiver, unless the
// runner stopped the session.
func (s *disruptionSession) fail(side string, err error) {
	if s.stopped.Load() {
		return
	}
	s.errMu.Lock()
	s.x.SessionErrs = append(s.x.SessionErrs, fmt.Sprintf("%s: %v", side, err))
	s.errMu.Unlock()
}

// send writes until the session stops.
func (s *disruptionSession) send() {
	defer s.wg.Done()
	for !s.stopped.Load() {
		if _, err := s.snd.Write(payload); err != nil {
			s.fail("sender write", err)
			return
		}
	}
}

// receive reads until the session stops.
func (s *disruptionSession) receive() {
	defer s.wg.Done()
	buf := make([]byte, 256<<10)
	for {
		n, err := s.rcv.Read(buf)
		s.appRx.Add(int64(n))
		if err != nil {
			if err == io.EOF {
				err = errors.New("closed by the peer")
			}
			s.fail("receiver read", err)
			return
		}
	}
}

// stop ends the session (once) and waits up to 10 s for its sender and
// receiver.
func (s *disruptionSession) stop() {
	if s.stopped.Swap(true) {
		return
	}
	// RST: no FIN exchange, no TIME_WAIT.
	s.snd.SetLinger(0)
	s.rcv.SetLinger(0)
	s.snd.Close()
	s.rcv.Close()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
	}
}

// close stops the session and the server's listener.
func (s *disruptionSession) close() {
	s.stop()
	s.ln.Close()
}

// sample samples the session every disruptionBin for o.DisruptionTime and
// starts the reconfiguration at disruptionAt; it returns the
// reconfiguration command's outcome once it is over.
func (dl *DisruptionLab) sample(ctx context.Context, o *Options, x *DisruptionRun, s *disruptionSession) (reconfigCommand, error) {
	t0 := time.Now()
	since := func(t time.Time) float64 { return t.Sub(t0).Seconds() }
	at := disruptionAt(o)
	recDone := make(chan struct{})
	started := false
	var rec reconfigCommand
	var recStart, recEnd time.Time
	var prev DisruptionSample
	var prevApp int64
	if ri, err := tcpInfo(s.rcv); err == nil {
		prev.Bytes = ri.Bytes_received // cumulative, the base of the first bin
	}
	prevApp = s.appRx.Load()
	tick := time.NewTicker(disruptionBin)
	defer tick.Stop()
	var sampleErr error
	for time.Since(t0) < o.DisruptionTime {
		select {
		case <-ctx.Done():
			return reconfigCommand{}, ctx.Err()
		case <-tick.C:
		}
		now := time.Now()
		if since(now)-prev.T < disruptionBin.Seconds()/2 {
			// The ticker's buffered tick right after a late one (this
			// process was not scheduled in time): a bin of a few ms
			// would be an empty "dip" that only the sampler made.
			continue
		}
		si, err1 := tcpInfo(s.snd)
		ri, err2 := tcpInfo(s.rcv)
		app := s.appRx.Load()
		if err := errors.Join(err1, err2); err != nil {
			sampleErr = err
			break
		}
		smp := DisruptionSample{T: since(now), Bytes: ri.Bytes_received - prev.Bytes, AppBytes: app - prevApp,
			Cwnd: si.Snd_cwnd, Ssthresh: si.Snd_ssthresh, Retrans: si.Total_retrans, RttUs: si.Rtt, CaState: si.Ca_state,
			ReordSeen: si.Reord_seen, DsackDups: si.Dsack_dups, RcvOoo: ri.Rcv_ooopack,
			Unacked: si.Unacked, Sacked: si.Sacked, Lost: si.Lost, Reordering: si.Reordering, Rtos: uint32(si.Total_rto)}
		if dt := smp.T - prev.T; dt > 0 {
			smp.Gbps = float64(smp.Bytes) * 8 / dt / 1e9
		}
		// prev.Bytes holds the cumulative count for the next bin.
		prevApp = app
		x.Samples = append(x.Samples, smp)
		prev = smp
		prev.Bytes = ri.Bytes_received
		if !started && time.Since(t0) >= at {
			started = true
			x.ReconfigAt = since(time.Now())
			go func() {
				defer close(recDone)
				recStart = time.Now()
				rec.out, rec.err = labkit.Run(ctx, dl.lab, "client", 30*time.Second, x.ReconfigArgv...)
				recEnd = time.Now()
			}()
		}
	}
	if !started {
		return reconfigCommand{}, fmt.Errorf("sampling stopped before the reconfiguration (%v)", sampleErr)
	}
	<-recDone
	x.ReconfigStart, x.ReconfigEnd = since(recStart), since(recEnd)
	if sampleErr != nil {
		x.problem("TCP_INFO could not be read after %.2f s: %v (the session's sockets are gone)", since(time.Now()), sampleErr)
	}
	return rec, nil
}

// reconfigCommand is what the reconfiguration command printed, and its
// error.
type reconfigCommand struct {
	out string
	err error
}
