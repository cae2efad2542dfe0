#!/usr/bin/env bash
# make demo: a lab with real programs, sessions steered through a chain of
# two unmodified middleboxes (an iptables firewall whose FORWARD policy is
# DROP, and a tcpdump monitor on the session-view tap); a live download whose
# middleboxes are deleted while it runs; an unmodified HAProxy that removes
# itself from the session it relays (libdysco); central policies from a policy
# server over mutual TLS (certificates from `dysco certs`); then teardown; and last the
# paper's proxy-removal experiment (`dysco lab run proxy-removal --quick`):
# 200 live sessions (--quick; --full: 600), goodput and the proxy's CPU, nothing lost.
set -euo pipefail
cd "$(dirname "$0")/.."
D=bin/dysco
LAB=demo
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() {
  [ -n "${ps:-}" ] && kill "$ps" 2>/dev/null && wait "$ps" 2>/dev/null
  $D lab down --name "$LAB" >/dev/null 2>&1 || true
  rm -rf "$work"
}
work=$(mktemp -d)
trap cleanup EXIT INT TERM
$D lab down --name "$LAB" >/dev/null 2>&1 || true

say "Certificates of the management plane (dysco certs): a CA, the policy server's, one per agent, the operator's"
PKI=$work/pki PS=https://10.200.1.1:7017
$D certs ca --dir "$PKI" | sed 's/^/  /'
$D certs server --dir "$PKI" --ip 10.200.1.1 | sed 's/^/  /'
$D certs agent client mb1 mb2 server --dir "$PKI" | sed 's/^/  /'
$D certs operator --dir "$PKI" | sed 's/^/  /'

say "Building a lab: client, mb1, mb2, server around a router (plain routing would bypass mb1 and mb2); every agent has the deployment key and its certificate"
$D lab up --name "$LAB" --topology star --hosts client,mb1,mb2,server --agent-arg=--close-linger=2s \
  --agent-arg=--policy-server=$PS --agent-arg=--pki-dir="$PKI"
on() { local h=$1; shift; ip netns exec "$LAB-$h" "$@"; }
CLIENT=10.200.1.2 MB1=10.200.2.2 MB2=10.200.3.2 SERVER=10.200.4.2

say "The policy server runs in the router's namespace: HTTPS, mutual TLS"
ip netns exec "$LAB-router" $D policy-server --listen 10.200.1.1:7017 --pki-dir "$PKI" --db "$work/policy.db" \
  --ready-file "$work/ps.ready" > "$work/ps.log" 2>&1 &
ps=$!
for _ in $(seq 100); do [ -s "$work/ps.ready" ] && break; kill -0 $ps 2>/dev/null || { cat "$work/ps.log"; exit 1; }; sleep 0.1; done
[ -s "$work/ps.ready" ] || { echo "  the policy server did not start:"; cat "$work/ps.log"; exit 1; }
echo "  serving on $(cat "$work/ps.ready")"

say "mb1 runs a stateful firewall: FORWARD policy DROP, only new SYNs to the server's port 80 and established sessions pass"
on mb1 iptables -P FORWARD DROP
on mb1 iptables -A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
on mb1 iptables -A FORWARD -p tcp --syn -d $SERVER --dport 80 -m conntrack --ctstate NEW -j ACCEPT
on mb1 iptables -S FORWARD

say "server runs nginx with a 50 MB file"
mkdir -p "$work/www"
head -c $((50 << 20)) /dev/urandom > "$work/www/blob"
cat > "$work/nginx.conf" <<CONF
user root; worker_processes 1; daemon on; pid $work/nginx.pid; error_log $work/nginx.err;
events {}
http { access_log off; client_body_temp_path $work/body; server { listen $SERVER:80; root $work/www; } }
CONF
on server nginx -c "$work/nginx.conf" -p "$work"

say "Without a policy the session goes straight to the server: the firewall never sees it"
on client curl -s -o /dev/null -w "  curl: HTTP %{http_code}, %{size_download} bytes\n" http://$SERVER/blob
on mb1 conntrack -C | sed 's/^/  mb1 conntrack entries: /'

say "Policy on the client: sessions to port 80 go through mb1, then mb2"
on client $D policy add web --chain $MB1,$MB2 'tcp dst port 80'
on client $D policy list

say "mb2 monitors the sessions on its session-view tap (tcpdump -i dysco-tap)"
on mb2 tcpdump -l -n -i dysco-tap -c 4 'tcp port 80' > "$work/tap.txt" 2>/dev/null &
tap=$!
# The datapath copies to the tap only while a capture is open; wait until
# mb2's agent has seen tcpdump's.
for _ in $(seq 100); do on mb2 $D status -o json | grep -q '"tap_active": *true' && break; sleep 0.1; done

say "Three transfers through the chain, each checked against the file's SHA-256"
want=$(sha256sum < "$work/www/blob" | cut -d' ' -f1)
for i in 1 2 3; do
  got=$(on client curl -s http://$SERVER/blob | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] && echo "  transfer $i: 50 MB, sha256 matches" || { echo "  transfer $i: MISMATCH"; exit 1; }
done
wait $tap 2>/dev/null || true
echo "  mb2's tap saw the session tuple ($CLIENT -> $SERVER):"; sed 's/^/    /' "$work/tap.txt"

say "Live sessions on each host (session tuple, subsessions on each side, counters)"
for h in client mb1 mb2 server; do echo "  -- $h"; on $h $D sessions | sed 's/^/  /'; done
say "mb1's firewall holds the session tuple in conntrack"
on mb1 conntrack -L -p tcp --dport 80 2>/dev/null | head -3 | sed 's/^/  /'

say "Datapath counters on mb1"
on mb1 $D status | sed -n '/counters/,$p' | awk '$2 != 0' | sed 's/^/  /'

say "Live reconfiguration (§3): a slow download through mb1 and mb2; the client deletes both from the session while it runs"
on client curl -s --limit-rate 12M -o "$work/live.bin" http://$SERVER/blob &
dl=$!
for _ in $(seq 100); do on mb1 $D sessions | grep -q established && break; sleep 0.05; done
sleep 1
on client $D reconfig --match 'tcp dst port 80' --to $SERVER | sed 's/^/  /'
before=$(on mb1 $D status -o json | grep -o '"rewrite_in": *[0-9]*' | grep -o '[0-9]*$')
wait $dl
[ "$(sha256sum < "$work/live.bin" | cut -d' ' -f1)" = "$want" ] && echo "  download finished after the reconfiguration: 50 MB, sha256 matches" || { echo "  live download: MISMATCH"; exit 1; }
after=$(on mb1 $D status -o json | grep -o '"rewrite_in": *[0-9]*' | grep -o '[0-9]*$')
echo "  packets mb1 rewrote after the reconfiguration: $((after - before)) (stragglers of the old path at most)"

say "Proxy removal (§2.4): HAProxy on mb2 (TCP mode, splicing) under LD_PRELOAD=lib/libdysco.so relays port 8080 to the server, then leaves the path"
cat > "$work/haproxy.cfg" <<CONF
global
    maxconn 100
defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    option splice-request
    option splice-response
listen relay
    bind $MB2:8080
    server backend $SERVER:80
CONF
on mb2 env LD_PRELOAD="$PWD/lib/libdysco.so" haproxy -D -p "$work/haproxy.pid" -f "$work/haproxy.cfg"
# Both TCP sessions must be Dysco sessions (a policy with no chain) so that
# they can be joined and the proxy removed.
on client $D policy add to-proxy 'tcp dst port 8080' | sed 's/^/  client: /'
on mb2 $D policy add to-server 'tcp dst port 80' | sed 's/^/  mb2: /'
for _ in $(seq 100); do on client bash -c "exec 3<>/dev/tcp/$MB2/8080" 2>/dev/null && break; sleep 0.05; done
got=$(on client curl -s --limit-rate 12M http://$MB2:8080/blob | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] && echo "  download through HAProxy: 50 MB, sha256 matches" || { echo "  download through HAProxy: MISMATCH"; exit 1; }
echo "  the client's agent removed the proxy (time from its request to the old path no longer used):"
on client $D reconfig history | tail -n +2 | tail -3 | sed 's/^/    /'
kill "$(cat "$work/haproxy.pid")" 2>/dev/null || true

say "Central policies: the operator's certificate may change them, a client without one may not"
code=$(on client curl -s -o /dev/null -w '%{http_code}' --cacert "$PKI/ca.crt" -X PUT --data '{}' $PS/v1/policies/ssh || true)
echo "  curl with no client certificate, PUT /v1/policies/ssh: HTTP $code"
[ "$code" = 401 ] || { echo "  expected 401"; exit 1; }
on client $D policy add ssh --server $PS --pki-dir "$PKI" --host client --chain $MB1 'tcp dst port 22' | sed 's/^/  /'
for _ in $(seq 100); do on client $D policy list | grep -q '^ssh' && break; sleep 0.1; done
echo "  the client's agent took it from the server (watching with its agent certificate):"
on client $D policy list | sed 's/^/    /'
on client $D policy rm ssh --server $PS --pki-dir "$PKI" | sed 's/^/  /'

say "Teardown: sessions end with their TCP sessions (FIN), state is collected"
for _ in $(seq 150); do
  n=0; for h in client mb1 mb2 server; do n=$((n + $(on $h $D status -o json | grep -o '"sessions": *[0-9]*' | grep -o '[0-9]*$'))); done
  [ "$n" -eq 0 ] && break; sleep 0.1
done
for h in client mb1 mb2 server; do printf '  %-6s %s\n' $h "$(on $h $D sessions)"; done

say "Removing the lab"
kill $ps 2>/dev/null; wait $ps 2>/dev/null || true; ps=
$D lab down --name "$LAB" >/dev/null

say "The paper's Figures 12 and 13: bundles of live sessions through HAProxy (libdysco), the proxy removed one bundle at a time"
echo "  dysco lab run proxy-removal --quick   (progress below; raw data, plots and report in out/experiments/proxy-removal)"
$D lab run proxy-removal --quick --out out/experiments/proxy-removal > "$work/result.txt"
say "Results"
cat "$work/result.txt"
