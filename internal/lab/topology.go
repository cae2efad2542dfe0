package lab

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
)

// Role says what a host does in a scenario. It decides which hosts forward
// packets and which get a session-view tap; the agent is the same everywhere.
type Role string

// The roles of a host. RoleRouter is used only for the router namespace that
// the lab itself adds to a star topology; a topology file may not name it.
const (
	RoleClient    Role = "client"
	RoleServer    Role = "server"
	RoleMiddlebox Role = "middlebox"
	RoleHost      Role = "host"
	RoleRouter    Role = "router"
)

// roleNames are the names a role may be given by (ParseRole): the roles'
// own, and the short "mb" and "plain" that match the host names the lab
// infers roles from.
var roleNames = map[string]Role{
	"client": RoleClient, "server": RoleServer,
	"middlebox": RoleMiddlebox, "mb": RoleMiddlebox,
	"host": RoleHost, "plain": RoleHost,
}

// ParseRole reads a role given explicitly, in a host list (NAME=ROLE) or a
// topology file: client, server, middlebox (or mb) or host (or plain). The
// router role is the lab's own and cannot be given.
func ParseRole(s string) (Role, error) {
	if r, ok := roleNames[s]; ok {
		return r, nil
	}
	return "", fmt.Errorf("role %q is unknown: use client, server, middlebox (or mb) or host (or plain)", s)
}

// ParseHosts reads a host list as `dysco lab up --hosts` takes it: each
// entry NAME, whose role follows the name (InferRole), or NAME=ROLE
// (ParseRole), for example "client", "fw=mb", "ids=middlebox"; then :2 for
// a second link, and +session for session addresses (HostSpec), for
// example "client:2+session". Names are checked by Topology.Validate.
func ParseHosts(list []string) ([]HostSpec, error) {
	hs := make([]HostSpec, len(list))
	for i, e := range list {
		e, sess := strings.CutSuffix(e, "+session")
		spec, links, multi := strings.Cut(e, ":")
		n := 0
		if multi {
			if links != "1" && links != "2" {
				return nil, fmt.Errorf("host %q: %q links: a host has 1 or 2 (give NAME:2 for a second link)", e, links)
			}
			n = int(links[0] - '0')
		}
		name, role, explicit := strings.Cut(spec, "=")
		if !explicit {
			hs[i] = HostSpec{Name: name, Role: InferRole(name), Links: n, SessionAddr: sess}
			continue
		}
		if name == "" {
			return nil, fmt.Errorf("host %q: no name before the role (give NAME=ROLE, for example fw=mb)", e)
		}
		r, err := ParseRole(role)
		if err != nil {
			return nil, fmt.Errorf("host %q: %w", name, err)
		}
		hs[i] = HostSpec{Name: name, Role: r, Links: n, SessionAddr: sess}
	}
	return hs, nil
}

// InferRole guesses a host's role from its name, as `dysco lab up --hosts`
// does for a name given without a role: "mb*" is a middlebox, "client*" a
// client, "server*" a server, and anything else a plain host.
func InferRole(name string) Role {
	switch {
	case strings.HasPrefix(name, "mb"):
		return RoleMiddlebox
	case strings.HasPrefix(name, "client"):
		return RoleClient
	case strings.HasPrefix(name, "server"):
		return RoleServer
	}
	return RoleHost
}

// Kind is the shape of a topology.
type Kind string

// The topology kinds the lab builds.
const (
	// KindStar puts every host on its own subnet, attached to one router
	// namespace, with default routes via the router (paper Fig. 11). Plain
	// routing between two hosts passes through the router only, never through
	// a middlebox host: Dysco has to steer sessions through middleboxes.
	KindStar Kind = "star"
	// KindLine puts the hosts in a line, each adjacent pair on its own link,
	// with no router: intermediate hosts forward, and static routes make the
	// two ends reach each other through the whole line (paper Fig. 1).
	KindLine Kind = "line"
)

// HostSpec is one host of a topology.
type HostSpec struct {
	// Name is the host's name, ^[a-z][a-z0-9]{0,9}$. Its namespace is
	// "<lab>-<name>".
	Name string `json:"name"`
	// Role is the host's role; empty means InferRole(Name).
	Role Role `json:"role,omitempty"`
	// Links is the number of links to the star's router, 1 (the default,
	// also when 0) or 2: a multihomed host, with a second interface on a
	// second subnet (see Host).
	Links int `json:"links,omitempty"`
	// SessionAddr gives a star's host session addresses (Host.SessionAddr4
	// and SessionAddr6) on its loopback interface, which its agent gets with
	// --session-addr: its sessions keep their tuple when its other
	// addresses change (docs/mobility.md).
	SessionAddr bool `json:"session_addr,omitempty"`
}

// Topology is a lab's hosts and how they are connected. It is what a
// topology file under topologies/ holds, as JSON:
//
//	{"name": "fig11", "kind": "star",
//	 "hosts": [{"name": "client1", "role": "client"}, {"name": "mb1"}]}
//
// The order of Hosts matters: it decides the addresses (see Host).
type Topology struct {
	// Name describes the topology (for example "fig11"); it is not the lab's
	// name and may be empty.
	Name string `json:"name,omitempty"`
	// Kind is KindStar or KindLine.
	Kind Kind `json:"kind"`
	// Hosts are the hosts, in address order. The star's router is not one
	// of them.
	Hosts []HostSpec `json:"hosts"`
}

// Limits on names, so that namespace names stay short and a lab's leftovers
// are easy to spot: a namespace is "<lab>-<host>", and neither part has a dash.
var (
	labNameRE  = regexp.MustCompile(`^[a-z][a-z0-9]{0,7}$`)
	hostNameRE = regexp.MustCompile(`^[a-z][a-z0-9]{0,9}$`)
)

// maxHosts bounds a topology: star host i (or line link i) uses the subnet
// 10.200.i.0/24 (10.201.i.0/24), so i stays within one octet.
const maxHosts = 254

// routerName is the name of the star topology's router; no host may take it.
const routerName = "router"

// ValidateLabName reports whether name can name a lab.
func ValidateLabName(name string) error {
	if !labNameRE.MatchString(name) {
		return fmt.Errorf("lab name %q is invalid: use 1 to 8 lower-case letters or digits, starting with a letter (for example \"demo\" or \"lt42\")", name)
	}
	return nil
}

func validateHostName(name string) error {
	if !hostNameRE.MatchString(name) {
		return fmt.Errorf("host name %q is invalid: use 1 to 10 lower-case letters or digits, starting with a letter (for example \"client1\" or \"mb2\")", name)
	}
	if name == routerName {
		return fmt.Errorf("host name %q is reserved for the star topology's router namespace: pick another name", name)
	}
	return nil
}

// Validate checks the topology and reports the first problem found.
func (t Topology) Validate() error {
	switch t.Kind {
	case KindStar, KindLine:
	case "":
		return errors.New(`topology has no "kind": use "star" or "line"`)
	default:
		return fmt.Errorf("topology kind %q is unknown: use \"star\" or \"line\"", t.Kind)
	}
	min := 1
	if t.Kind == KindLine {
		min = 2
	}
	if len(t.Hosts) < min || len(t.Hosts) > maxHosts {
		return fmt.Errorf("%s topology has %d hosts: it needs %d to %d", t.Kind, len(t.Hosts), min, maxHosts)
	}
	seen := make(map[string]bool)
	for _, h := range t.Hosts {
		if err := validateHostName(h.Name); err != nil {
			return err
		}
		if seen[h.Name] {
			return fmt.Errorf("host %q appears twice in the topology: host names must be unique", h.Name)
		}
		seen[h.Name] = true
		if h.Role != "" {
			if _, err := ParseRole(string(h.Role)); err != nil {
				return fmt.Errorf("host %q: %w", h.Name, err)
			}
		}
		switch {
		case h.Links < 0 || h.Links > 2:
			return fmt.Errorf("host %q has %d links: a host has 1 or 2", h.Name, h.Links)
		case h.Links == 2 && t.Kind != KindStar:
			return fmt.Errorf("host %q has 2 links: only a star topology's hosts can have a second link", h.Name)
		case h.SessionAddr && t.Kind != KindStar:
			return fmt.Errorf("host %q has a session address: only a star topology's hosts can have one", h.Name)
		}
	}
	return nil
}

// withRoles returns a copy of t in which every host has a role.
func (t Topology) withRoles() Topology {
	hosts := make([]HostSpec, len(t.Hosts))
	for i, h := range t.Hosts {
		if h.Role == "" {
			h.Role = InferRole(h.Name)
		} else if r, err := ParseRole(string(h.Role)); err == nil {
			h.Role = r // "mb" and "plain" are middlebox and host
		}
		hosts[i] = h
	}
	t.Hosts = hosts
	return t
}

// specs turns host names into host specs with inferred roles.
func specs(names []string) []HostSpec {
	hs := make([]HostSpec, len(names))
	for i, n := range names {
		hs[i] = HostSpec{Name: n, Role: InferRole(n)}
	}
	return hs
}

// Star returns a star topology (paper Fig. 11) of the named hosts, with
// roles inferred from the names.
func Star(hosts ...string) Topology {
	return Topology{Name: "star", Kind: KindStar, Hosts: specs(hosts)}
}

// Line returns a line topology (paper Fig. 1) of the named hosts, in order
// from one end to the other, with roles inferred from the names.
func Line(hosts ...string) Topology {
	return Topology{Name: "line", Kind: KindLine, Hosts: specs(hosts)}
}

// DefaultLineHosts are the hosts of the built-in line topology: the paper's
// Fig. 1, where host A opens a session to D through middleboxes B and C.
var DefaultLineHosts = []string{"client", "mb1", "mb2", "server"}

// Fig11 returns the paper's testbed (Fig. 11): four clients, four servers
// and two middlebox hosts around one router.
func Fig11() Topology {
	t := Star("client1", "client2", "client3", "client4",
		"server1", "server2", "server3", "server4", "mb1", "mb2")
	t.Name = "fig11"
	return t
}

// Builtins are the names Builtin accepts.
var Builtins = []string{"star", "line", "fig11"}

// Builtin returns a built-in topology by name: "star" (of hosts, which must
// not be empty), "line" (of hosts, or DefaultLineHosts if hosts is empty) or
// "fig11" (hosts must be empty). Hosts are as ParseHosts reads them: NAME or
// NAME=ROLE.
func Builtin(name string, hosts []string) (Topology, error) {
	var t Topology
	specs, err := ParseHosts(hosts)
	if err != nil {
		return t, err
	}
	switch name {
	case "star":
		if len(hosts) == 0 {
			return t, errors.New("the star topology needs hosts: give them as a list, for example client,mb1,server or client,fw=mb,server")
		}
		t = Topology{Name: "star", Kind: KindStar, Hosts: specs}
	case "line":
		if len(hosts) == 0 {
			t = Line(DefaultLineHosts...)
		} else {
			t = Topology{Name: "line", Kind: KindLine, Hosts: specs}
		}
	case "fig11":
		if len(hosts) != 0 {
			return t, errors.New("the fig11 topology has fixed hosts: do not give a host list (use the star topology for your own hosts)")
		}
		t = Fig11()
	default:
		return t, fmt.Errorf("topology %q is not built in: use one of %s, or a topology file", name, strings.Join(Builtins, ", "))
	}
	return t, t.Validate()
}

// ParseTopology decodes and validates a topology in JSON. Unknown fields are
// errors, so that a typo does not go unnoticed.
func ParseTopology(data []byte) (Topology, error) {
	var t Topology
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&t); err != nil {
		return Topology{}, fmt.Errorf("decoding topology: %w", err)
	}
	// Decode stops after the first JSON value: anything but white space
	// after it (a second object, a stray brace) is an error too, or it
	// would be silently ignored (found by FuzzParseTopology).
	if _, err := dec.Token(); err != io.EOF {
		return Topology{}, errors.New("decoding topology: unexpected data after the topology object")
	}
	if err := t.Validate(); err != nil {
		return Topology{}, err
	}
	return t, nil
}

// LoadTopology reads a topology file (see Topology for the format).
func LoadTopology(path string) (Topology, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Topology{}, fmt.Errorf("reading topology file: %w", err)
	}
	t, err := ParseTopology(data)
	if err != nil {
		return Topology{}, fmt.Errorf("topology file %s: %w", path, err)
	}
	return t, nil
}
