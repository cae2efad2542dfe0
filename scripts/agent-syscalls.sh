#!/bin/bash
# agent-syscalls.sh [DYSCO_BINARY]: counts the bpf() system calls the agents
# make while short sessions come and go (BENCHMARKS.md, "The agents' system
# calls"). A line lab client - mb1 - server (named lsys), the client chaining
# port 9000 through mb1; wrk opens a new connection per request (Connection:
# close) for 4 s against python3's http.server; then the script waits until
# every agent has collected every session, polling `dysco sessions` on each
# host once a second (as an operator's dashboard would). Prints the requests
# made and the agents' bpf() calls by command number (include/uapi/linux/
# bpf.h: 1 lookup, 3 delete, 10 program run, 24 batch lookup, 27 batch
# delete). Needs root, bpftrace, wrk and python3; removes its lab on exit.
set -euo pipefail
B=${1:-bin/dysco}
N=lsys
COMM=$(basename "$B" | cut -c1-15)
OUT=$(mktemp)
cleanup() {
	pkill -INT -f "bpftrace.*$COMM" 2>/dev/null || true
	[ -n "${SP:-}" ] && kill "$SP" 2>/dev/null || true
	"$B" lab down --name $N >/dev/null 2>&1 || true
	rm -f "$OUT"
}
trap cleanup EXIT
"$B" lab up --name $N --topology line --hosts client,mb1,server >/dev/null
addr() { ip netns exec "$N-$1" ip -4 -o addr show | awk '$2!="lo"{print $4}' | cut -d/ -f1 | head -1; }
MB1=$(addr mb1)
SRV=$(addr server)
ip netns exec $N-client "$B" policy add p --chain "$MB1" 'tcp dst port 9000' >/dev/null
WWW=$(mktemp -d)
echo hi >"$WWW/index.html"
ip netns exec $N-server python3 -m http.server 9000 --bind "$SRV" --directory "$WWW" >/dev/null 2>&1 &
SP=$!
for _ in $(seq 100); do
	ip netns exec $N-server ss -Hltn 'sport = :9000' | grep -q . && break
	sleep 0.1
done
bpftrace -e "tracepoint:syscalls:sys_enter_bpf /comm == \"$COMM\"/ { @[args->cmd] = count(); }" >"$OUT" 2>&1 &
until grep -q Attaching "$OUT"; do sleep 0.1; done
ip netns exec $N-client wrk -t1 -c8 -d4s -H "Connection: close" "http://$SRV:9000/" | grep -E "requests in|Socket errors" || true
for i in $(seq 120); do
	n=0
	for h in client mb1 server; do
		n=$((n + $(ip netns exec $N-$h "$B" sessions -o json | { grep -o '"id"' || true; } | wc -l)))
	done
	[ "$n" -eq 0 ] && break
	sleep 1
done
echo "sessions left: $n (polled $i times)"
pkill -INT -f "bpftrace.*$COMM"
until grep -q "^@" "$OUT"; do sleep 0.1; done
sleep 0.5
echo "bpf() calls by command:"
grep "^@" "$OUT" | sort -t: -k2 -n
rm -rf "$WWW"
