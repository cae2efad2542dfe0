package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// Summary is what get prints (one JSON object on stdout), also when it
// fails.
type Summary struct {
	URL     string  `json:"url"`
	OK      bool    `json:"ok"`
	Bytes   int64   `json:"bytes"`
	SHA256  string  `json:"sha256"`
	Seconds float64 `json:"seconds"`
	// Mbps is the average goodput of the body, in megabits per second.
	Mbps float64 `json:"mbps"`
	// Local and Remote are the connection's addresses as the client saw them.
	Local  string `json:"local,omitempty"`
	Remote string `json:"remote,omitempty"`
	Error  string `json:"error,omitempty"`
}

// Sample is one throughput sample (--interval), a JSON line in --samples.
type Sample struct {
	// T is the end of the interval, in seconds since the request was sent.
	T float64 `json:"t"`
	// At is the same instant as Unix time in seconds, to line up the
	// samples of several clients.
	At float64 `json:"at"`
	// Bytes is the body received so far; Mbps the rate over the interval.
	Bytes int64   `json:"bytes"`
	Mbps  float64 `json:"mbps"`
}

func getMain(args []string) error {
	fs := flag.NewFlagSet("get", flag.ContinueOnError)
	insecure := fs.Bool("insecure", false, "do not verify the server's certificate")
	caPath := fs.String("ca", "", "verify the server's certificate against the PEM certificate in `FILE` (serve --cert)")
	outPath := fs.String("out", "", "write the body to `FILE` (default: discard it)")
	interval := fs.Duration("interval", 0, "take a throughput sample every `D` (for example 100ms); needs --samples")
	samplesPath := fs.String("samples", "", "write the throughput samples as JSON lines to `FILE`")
	timeout := fs.Duration("timeout", 5*time.Minute, "give up (an error) after `D`")
	// Flags may follow the URL, as in `get URL --insecure`.
	var rawURL string
	for {
		if err := fs.Parse(args); err != nil {
			return err
		}
		if fs.NArg() == 0 {
			break
		}
		if rawURL != "" {
			return fmt.Errorf("get: more than one URL: %q and %q", rawURL, fs.Arg(0))
		}
		rawURL, args = fs.Arg(0), fs.Args()[1:]
	}
	if rawURL == "" {
		return errors.New("get: no URL")
	}
	if (*interval > 0) != (*samplesPath != "") {
		return errors.New("get: --interval and --samples go together")
	}
	tlsConf := &tls.Config{InsecureSkipVerify: *insecure, NextProtos: []string{http3.NextProtoH3}}
	if *caPath != "" {
		pem, err := os.ReadFile(*caPath)
		if err != nil {
			return err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("%s: no PEM certificate", *caPath)
		}
		tlsConf.RootCAs = pool
	}
	out := io.Discard
	if *outPath != "" {
		f, err := os.Create(*outPath)
		if err != nil {
			return err
		}
		defer f.Close()
		out = f
	}
	var samples io.Writer
	if *samplesPath != "" {
		f, err := os.Create(*samplesPath)
		if err != nil {
			return err
		}
		defer f.Close()
		samples = f
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	sum := get(ctx, rawURL, tlsConf, out, *interval, samples)
	b, _ := json.Marshal(sum)
	fmt.Println(string(b))
	if !sum.OK {
		return errors.New(sum.Error)
	}
	return nil
}

// get downloads u over one QUIC connection, dialled here and used for this
// request only: http3.Transport's pool could dial again after a failure,
// which would hide a reset.
func get(ctx context.Context, u string, tlsConf *tls.Config, out io.Writer, interval time.Duration, samples io.Writer) (sum Summary) {
	sum.URL = u
	start := time.Now()
	var got atomic.Int64
	fail := func(err error) Summary {
		sum.Bytes = got.Load()
		sum.Seconds = time.Since(start).Seconds()
		sum.Error = err.Error()
		if ctx.Err() != nil {
			sum.Error = fmt.Sprintf("gave up after %.1f s (--timeout): %v", sum.Seconds, err)
		}
		return sum
	}
	pu, err := url.Parse(u)
	if err != nil {
		return fail(err)
	}
	if pu.Scheme != "https" {
		return fail(fmt.Errorf("URL %q: the scheme must be https", u))
	}
	host, port := pu.Hostname(), pu.Port()
	if port == "" {
		port = "443"
	}
	tc := tlsConf.Clone()
	tc.ServerName = host
	conn, err := quic.DialAddr(ctx, net.JoinHostPort(host, port), tc, &quic.Config{})
	if err != nil {
		return fail(fmt.Errorf("dial: %w", err))
	}
	defer conn.CloseWithError(0, "")
	sum.Local, sum.Remote = conn.LocalAddr().String(), conn.RemoteAddr().String()
	cc := (&http3.Transport{}).NewClientConn(conn)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return fail(err)
	}
	resp, err := cc.RoundTrip(req)
	if err != nil {
		return fail(fmt.Errorf("request: %w", err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fail(fmt.Errorf("status %s: %s", resp.Status, b))
	}
	var stopSampling func()
	if interval > 0 {
		stopSampling = sample(start, interval, &got, samples)
	}
	h := sha256.New()
	_, err = io.Copy(io.MultiWriter(h, out, counter{&got}), resp.Body)
	if stopSampling != nil {
		stopSampling()
	}
	if err != nil {
		return fail(fmt.Errorf("body after %d bytes: %w", got.Load(), err))
	}
	sum.Bytes = got.Load()
	sum.Seconds = time.Since(start).Seconds()
	sum.SHA256 = hex.EncodeToString(h.Sum(nil))
	if sum.Seconds > 0 {
		sum.Mbps = float64(sum.Bytes) * 8 / 1e6 / sum.Seconds
	}
	if r := conn.RemoteAddr().String(); r != sum.Remote {
		return fail(fmt.Errorf("the connection's remote address changed from %s to %s", sum.Remote, r))
	}
	if resp.ContentLength >= 0 && resp.ContentLength != sum.Bytes {
		return fail(fmt.Errorf("received %d bytes, Content-Length %d", sum.Bytes, resp.ContentLength))
	}
	want := resp.Header.Get(hashHeader)
	if want == "" {
		return fail(fmt.Errorf("the response has no %s header", hashHeader))
	}
	if want != sum.SHA256 {
		return fail(fmt.Errorf("sha256 %s, the server's header says %s", sum.SHA256, want))
	}
	// The body of /bytes/N is known here too: a server that sent wrong
	// bytes with their right hash is caught as well.
	if n, err := parseBytesPath(pu.Path); err == nil {
		if n != sum.Bytes || streamHash(n) != sum.SHA256 {
			return fail(fmt.Errorf("the body is not the stream of /bytes/%d", n))
		}
	}
	sum.OK = true
	return sum
}

type counter struct{ n *atomic.Int64 }

func (c counter) Write(p []byte) (int, error) { c.n.Add(int64(len(p))); return len(p), nil }

// sample writes a Sample every interval until stopped (and a last one then).
func sample(start time.Time, interval time.Duration, got *atomic.Int64, w io.Writer) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	enc := json.NewEncoder(w)
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		last, lastT := int64(0), start
		for {
			// The last sample is taken after done, so it holds every
			// byte: a tick that raced with the end is not the last.
			var now time.Time
			final := false
			select {
			case now = <-t.C:
			case <-done:
				now, final = time.Now(), true
			}
			n := got.Load()
			s := Sample{T: now.Sub(start).Seconds(), At: float64(now.UnixNano()) / 1e9, Bytes: n}
			if d := now.Sub(lastT).Seconds(); d > 0 {
				s.Mbps = float64(n-last) * 8 / 1e6 / d
			}
			enc.Encode(s)
			if final {
				return
			}
			last, lastT = n, now
		}
	}()
	return func() { close(done); wg.Wait() }
}
