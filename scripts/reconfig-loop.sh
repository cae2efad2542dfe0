#!/bin/bash
# reconfig-loop.sh: time sequential reconfigurations of one live session in an
# otherwise idle star lab, for comparing agent builds (BENCHMARKS.md, "One
# wake-up less per message").
#
#   scripts/reconfig-loop.sh [BINARY [COUNT]]     (root; default bin/dysco, 200)
#
# Builds the star lab "rloop" (client, mb1, mb2, server), chains
# `tcp dst port 5201` through mb1, runs one iperf3 session at 2 Mbit/s and moves
# its data connection between mb2 and mb1 COUNT times, one reconfiguration
# after the other. Prints the successes and the medians of the phases from
# `dysco reconfig history --json` at the client (the left anchor). The lab is
# removed on exit, also on failure.
set -euo pipefail
BIN=${1:-bin/dysco}
N=${2:-200}
LAB=rloop
[ "$(id -u)" = 0 ] || { echo "reconfig-loop.sh: needs root" >&2; exit 1; }
[ -x "$BIN" ] || { echo "reconfig-loop.sh: no binary $BIN (make build)" >&2; exit 1; }
command -v iperf3 >/dev/null || { echo "reconfig-loop.sh: needs iperf3 (scripts/deps.sh)" >&2; exit 1; }
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "reconfig-loop.sh: COUNT must be a positive number, got $N" >&2; exit 1; }

cleanup() {
	pkill -f "iperf3 -c 10.200.4.2 -p 5201" 2>/dev/null || true
	"$BIN" lab down --name $LAB >/dev/null 2>&1 || true
}
trap cleanup EXIT
on() { local h=$1; shift; ip netns exec "$LAB-$h" "$@"; }
# wait_for DESCRIPTION COMMAND...: polls COMMAND for up to 10 s.
wait_for() {
	local what=$1; shift
	for _ in $(seq 100); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
	echo "reconfig-loop.sh: timed out waiting for $what" >&2
	exit 1
}

"$BIN" lab up --name $LAB --topology star --hosts client,mb1,mb2,server --agent-binary "$BIN" >/dev/null
on client "$BIN" policy add loop --chain 10.200.2.2 'tcp dst port 5201' >/dev/null
on server iperf3 -s -D -p 5201
wait_for "iperf3 to listen" sh -c "ip netns exec $LAB-server ss -ltn | grep -q ':5201 '"
on client sh -c 'iperf3 -c 10.200.4.2 -p 5201 -b 2M -t 3600 >/dev/null 2>&1 &'
# The control connection and the data connection.
wait_for "two chained sessions" sh -c "[ \$(ip netns exec $LAB-client $BIN sessions | wc -l) -ge 3 ]"
port=$(on client "$BIN" sessions | awk 'NR==3 { split($2, a, ":"); print a[2] }')

fails=0
for i in $(seq 1 "$N"); do
	if [ $((i % 2)) = 1 ]; then mb=10.200.3.2; else mb=10.200.2.2; fi
	on client "$BIN" reconfig --match "tcp port $port" --to 10.200.4.2 --chain $mb >/dev/null || fails=$((fails + 1))
	[ $((i % 50)) = 0 ] && echo "reconfig-loop.sh: $i of $N" >&2
done
on client "$BIN" reconfig history --json | python3 -c '
import json, statistics as S, sys
d = json.load(sys.stdin)["results"]
ok = [x for x in d if x["outcome"] == "succeeded"]
if not ok:
    sys.exit("reconfig-loop.sh: no reconfiguration succeeded")
m = sorted(x["micros"] for x in ok)
ms = lambda v: "%.2f ms" % (v / 1000)
print("%s: %d of %d succeeded; p50 %s, p90 %s; medians: locking %s, new path set-up %s, two-path phase %s" % (
    sys.argv[1], len(ok), len(d), ms(S.median(m)), ms(m[len(m) * 9 // 10]),
    ms(S.median(x["lock_micros"] for x in ok)),
    ms(S.median(x["setup_micros"] - x["lock_micros"] for x in ok)),
    ms(S.median(x["micros"] - x["setup_micros"] for x in ok))))
' "$BIN"
[ "$fails" = 0 ] || { echo "reconfig-loop.sh: $fails reconfigurations failed" >&2; exit 1; }
