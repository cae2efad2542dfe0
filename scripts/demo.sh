#!/usr/bin/env bash
# make demo: a lab with real programs, sessions steered through a chain of
# two unmodified middleboxes (an iptables firewall whose FORWARD policy is
# DROP, and a tcpdump monitor on the session-view tap), then teardown.
set -euo pipefail
cd "$(dirname "$0")/.."
D=bin/dysco
LAB=demo
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() { $D lab down --name "$LAB" >/dev/null 2>&1 || true; rm -rf "$work"; }
work=$(mktemp -d)
trap cleanup EXIT INT TERM
$D lab down --name "$LAB" >/dev/null 2>&1 || true

say "Building a lab: client, mb1, mb2, server around a router (plain routing would bypass mb1 and mb2)"
$D lab up --name "$LAB" --topology star --hosts client,mb1,mb2,server --agent-arg=--close-linger=2s
on() { local h=$1; shift; ip netns exec "$LAB-$h" "$@"; }
CLIENT=10.200.1.2 MB1=10.200.2.2 MB2=10.200.3.2 SERVER=10.200.4.2

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

say "Teardown: sessions end with their TCP sessions (FIN), state is collected"
for _ in $(seq 150); do
  n=0; for h in client mb1 mb2 server; do n=$((n + $(on $h $D status -o json | grep -o '"sessions": *[0-9]*' | grep -o '[0-9]*$'))); done
  [ "$n" -eq 0 ] && break; sleep 0.1
done
for h in client mb1 mb2 server; do printf '  %-6s %s\n' $h "$(on $h $D sessions)"; done

say "Removing the lab"
