// Command fakeagent stands in for `dysco agent` in the lab's tests. It
// checks the arguments the lab gives an agent, writes what it saw (its
// namespace, its pin directory's file system) into its ready file, and waits
// for SIGTERM.
//
//	fakeagent agent --name H --ready-file F --pin-dir D [--tap T]
//	          [--exit-early MSG] [--never-ready] [--extra X]
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
)

// bpfFSMagic is BPF_FS_MAGIC from linux/magic.h.
const bpfFSMagic = 0xcafe4a11

// Info is what the fake agent writes into its ready file.
type Info struct {
	Name       string   `json:"name"`
	PinDir     string   `json:"pin_dir"`
	PinOnBPFFS bool     `json:"pin_on_bpffs"`
	Tap        string   `json:"tap"`
	Extra      string   `json:"extra"`
	NetnsIno   uint64   `json:"netns_ino"`
	Ifaces     []string `json:"ifaces"`
}

func main() {
	if len(os.Args) < 2 || os.Args[1] != "agent" {
		fmt.Fprintln(os.Stderr, "fakeagent: usage: fakeagent agent --name H --ready-file F --pin-dir D")
		os.Exit(2)
	}
	fs := flag.NewFlagSet("agent", flag.ExitOnError)
	name := fs.String("name", "", "host name")
	ready := fs.String("ready-file", "", "file to write when ready")
	pinDir := fs.String("pin-dir", "", "BPF pin directory")
	fs.String("state-dir", "", "agent state directory")
	fs.String("control-key-file", "", "deployment key file")
	tap := fs.String("tap", "", "session-view tap")
	extra := fs.String("extra", "", "an extra argument, echoed into the ready file")
	exitEarly := fs.String("exit-early", "", "print this to stderr and exit 1 before ready")
	neverReady := fs.Bool("never-ready", false, "never write the ready file")
	fs.Parse(os.Args[2:])
	if *name == "" || *ready == "" || *pinDir == "" {
		fmt.Fprintln(os.Stderr, "fakeagent: --name, --ready-file and --pin-dir are required")
		os.Exit(2)
	}
	fmt.Printf("fakeagent %s: starting\n", *name)
	if *exitEarly != "" {
		fmt.Fprintf(os.Stderr, "fakeagent %s: %s\n", *name, *exitEarly)
		os.Exit(1)
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)

	info := Info{Name: *name, PinDir: *pinDir, Tap: *tap, Extra: *extra}
	var sfs syscall.Statfs_t
	if syscall.Statfs(*pinDir, &sfs) == nil {
		info.PinOnBPFFS = uint64(sfs.Type) == bpfFSMagic
	}
	var st syscall.Stat_t
	if syscall.Stat("/proc/self/ns/net", &st) == nil {
		info.NetnsIno = st.Ino
	}
	ifs, _ := net.Interfaces()
	for _, i := range ifs {
		info.Ifaces = append(info.Ifaces, i.Name)
	}
	if !*neverReady {
		data, _ := json.Marshal(info)
		tmp := *ready + ".tmp"
		if err := os.WriteFile(tmp, data, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "fakeagent:", err)
			os.Exit(1)
		}
		// The log line comes first: the lab returns as soon as the
		// ready file exists, and tests read the log then.
		fmt.Printf("fakeagent %s: ready\n", *name)
		if err := os.Rename(tmp, *ready); err != nil {
			fmt.Fprintln(os.Stderr, "fakeagent:", err)
			os.Exit(1)
		}
	}
	s := <-sigs
	fmt.Printf("fakeagent %s: %v, exiting\n", *name, s)
}
