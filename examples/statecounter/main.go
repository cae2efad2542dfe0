// Command statecounter is an example stateful middlebox helper that takes
// part in middlebox replacement with state transfer (paper §3.5, §5.3)
// through the dysco agent's "api" state plug-in.
//
// It counts, per TCP session, the bytes of stream each side sent (by
// sequence number, so retransmissions are not counted twice) and the
// packets, from every packet it sees on an interface (AF_PACKET, IPv4 and
// IPv6). It registers itself with the local agent as the state provider
// -name, serves the provider protocol on its own socket
// (docs/state-migration-plugins.md) so that its counters move with the
// session, and answers GET /v1/counters there.
//
//	statecounter -iface dysco-tap -agent-socket @dysco-agent -socket @statecounter
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/migrate"
)

func main() {
	iface := flag.String("iface", "", "interface to count packets on (required)")
	agentSocket := flag.String("agent-socket", api.AgentSocket, "the agent's local API socket (\"@name\" abstract)")
	name := flag.String("name", "statecounter", "provider name to register with the agent")
	socket := flag.String("socket", "@dysco-statecounter", "socket to serve the provider protocol on (\"@name\" abstract)")
	readyFile := flag.String("ready-file", "", "file to create once counting and registered")
	flag.Parse()
	if *iface == "" {
		fmt.Fprintln(os.Stderr, "statecounter: -iface is required")
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*iface, *agentSocket, *name, *socket, *readyFile); err != nil {
		log.Fatalf("statecounter: %v", err)
	}
}

func run(iface, agentSocket, name, socket, readyFile string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	tab := newTable()
	capt, err := openCapture(iface)
	if err != nil {
		return err
	}
	defer capt.Close()
	go func() {
		if err := capt.run(tab); err != nil && ctx.Err() == nil {
			log.Printf("statecounter: capture on %s: %v", iface, err)
			stop()
		}
	}()

	if !strings.HasPrefix(socket, "@") {
		_ = os.Remove(socket) // a stale socket of an earlier run
	}
	ln, err := net.Listen("unix", socket)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", socket, err)
	}
	srv := &http.Server{Handler: tab.handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()

	agent := newAgentClient(agentSocket)
	if err := agent.register(ctx, name, socket); err != nil {
		return err
	}
	log.Printf("statecounter: counting on %s, provider %q on %s registered with the agent on %s", iface, name, socket, agentSocket)
	if readyFile != "" {
		if err := os.WriteFile(readyFile, []byte("ready\n"), 0o644); err != nil {
			return err
		}
	}
	<-ctx.Done()
	uctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := agent.unregister(uctx, name); err != nil {
		log.Printf("statecounter: %v", err)
	}
	return nil
}

// agentClient talks to the agent's local API over its Unix socket, as the
// dysco CLI does (internal/api.Client); only the state-provider routes.
type agentClient struct {
	socket string
	hc     *http.Client
}

func newAgentClient(socket string) *agentClient {
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}
	return &agentClient{socket: socket, hc: &http.Client{Transport: tr, Timeout: 5 * time.Second}}
}

func (a *agentClient) do(ctx context.Context, method, path string, body any) error {
	var rd *strings.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = strings.NewReader(string(b))
	} else {
		rd = strings.NewReader("")
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://dysco-agent"+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := a.hc.Do(req)
	if err != nil {
		return fmt.Errorf("agent on %s: %w", a.socket, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		var e api.Error
		_ = json.NewDecoder(resp.Body).Decode(&e)
		return fmt.Errorf("agent on %s: %s %s: %s: %s", a.socket, method, path, resp.Status, e.Error)
	}
	return nil
}

// register registers the provider, retrying while the agent is not up yet
// (for 10 s).
func (a *agentClient) register(ctx context.Context, name, socket string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for {
		err := a.do(ctx, http.MethodPut, "/v1/state/providers/"+name, migrate.RegisterRequest{Socket: socket})
		if err == nil {
			return nil
		}
		var ne *net.OpError
		if !errors.As(err, &ne) {
			return err // the agent answered and refused
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("registering with the agent: %w", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (a *agentClient) unregister(ctx context.Context, name string) error {
	return a.do(ctx, http.MethodDelete, "/v1/state/providers/"+name, nil)
}
