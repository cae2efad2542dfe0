#!/bin/bash
# reconfig-trace.sh: where the time of a proxy removal goes, message by
# message (BENCHMARKS.md, "A proxy removal, message by message"). Runs the
# issue's benchmark with removals spaced 20 ms apart (`bench --only reconfig
# --reconfig-reps 1 --reconfig-open-rate 50`, 600 removals) while bpftrace
# records every control message an agent sends (sendto) or receives
# (recvfrom): time, agent, type and request number. Prints, per step of a
# removal at the client (left anchor), the proxy and the server (right
# anchor), the median, 25th and 75th percentile in µs: the hops (a message's
# sendto at one agent to its recvfrom at the next) and each agent's handling
# (its recvfrom to its next sendto).
#
#   scripts/reconfig-trace.sh [BINARY]     (root, bpftrace; default bin/dysco)
#
# BINARY must be named "dysco" (bpftrace picks the agents by command name).
# Tracing slows the agents: compare builds with this script against each
# other, not against the benchmark's own figures.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-bin/dysco}
[ "$(id -u)" = 0 ] || { echo "reconfig-trace.sh: needs root" >&2; exit 1; }
[ -x "$BIN" ] || { echo "reconfig-trace.sh: no binary $BIN (make build)" >&2; exit 1; }
[ "$(basename "$BIN")" = dysco ] || { echo "reconfig-trace.sh: the binary must be named dysco, got $BIN" >&2; exit 1; }
command -v bpftrace >/dev/null || { echo "reconfig-trace.sh: needs bpftrace" >&2; exit 1; }
command -v python3 >/dev/null || { echo "reconfig-trace.sh: needs python3" >&2; exit 1; }
# The syscall tracepoints live in tracefs, which not every machine mounts.
if [ ! -e /sys/kernel/tracing/events/syscalls ]; then
	mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
fi
[ -e /sys/kernel/tracing/events/syscalls/sys_enter_sendto ] ||
	{ echo "reconfig-trace.sh: no syscall tracepoints (tracefs at /sys/kernel/tracing)" >&2; exit 1; }
out=$(mktemp -d /tmp/reconfig-trace.XXXXXX)
bt=
cleanup() {
	[ -n "$bt" ] && kill -INT "$bt" 2>/dev/null || true
	jobs -p | xargs -r kill 2>/dev/null || true
	rm -rf "$out"
}
trap cleanup EXIT
go build -o bin/dysco-bench ./bench

# A control message begins with the magic 0x44595352 ("DYSR"); its type is
# byte 5, its flags byte 6, its request number bytes 104-107
# (internal/protocol/message.go, Encode). A bundle ("DYSB",
# internal/protocol/bundle.go) carries several datagrams' payloads, each
# after its 2-byte length from byte 6 on: its control messages are printed
# one by one, with the bundle's time (at most 8 of them; a bundle of
# 1232 bytes holds 6 messages without hops).
# bt_msgs TAG LEN: the bpftrace statements that print the control messages
# in the datagram at $b of LEN bytes, one line each, tagged S or R.
bt_msgs() {
	local tag=$1 len=$2
	cat <<BT
    if (*(uint32 *)uptr(\$b) == 0x52535944) {
      printf("%llu %d $tag %d %d %u\\n", nsecs, pid, *(uint8 *)uptr(\$b + 5), *(uint8 *)uptr(\$b + 6), *(uint32 *)uptr(\$b + 104));
    } else if (*(uint32 *)uptr(\$b) == 0x42535944) {
      \$n = (uint64)*(uint8 *)uptr(\$b + 5);
      \$o = (uint64)6;
      \$i = (uint64)0;
      unroll(8) {
        if (\$i < \$n && \$o + 2 + 108 <= $len) {
          \$l = ((uint64)*(uint8 *)uptr(\$b + \$o) << 8) | (uint64)*(uint8 *)uptr(\$b + \$o + 1);
          \$m = \$b + \$o + 2;
          if (*(uint32 *)uptr(\$m) == 0x52535944) {
            printf("%llu %d $tag %d %d %u\\n", nsecs, pid, *(uint8 *)uptr(\$m + 5), *(uint8 *)uptr(\$m + 6), *(uint32 *)uptr(\$m + 104));
          }
          \$o = \$o + 2 + \$l;
          \$i = \$i + 1;
        }
      }
    }
BT
}
bpftrace -e "
tracepoint:syscalls:sys_enter_sendto /comm == \"dysco\"/ {
    \$b = (uint8 *)args->buff;
$(bt_msgs S 'args->len')
}
tracepoint:syscalls:sys_enter_recvfrom /comm == \"dysco\"/ { @buf[tid] = args->ubuf; }
tracepoint:syscalls:sys_exit_recvfrom /comm == \"dysco\" && @buf[tid] != 0/ {
  if (args->ret > 108) {
    \$b = (uint8 *)@buf[tid];
$(bt_msgs R '(uint64)args->ret')
  }
  delete(@buf[tid]);
}" >"$out/bt" 2>&1 &
bt=$!
for _ in $(seq 100); do grep -q Attaching "$out/bt" && break; sleep 0.1; done
grep -q Attaching "$out/bt" || { echo "reconfig-trace.sh: bpftrace did not start:" >&2; cat "$out/bt" >&2; exit 1; }
# Which agent each process is, sampled while the lab runs.
(
	while sleep 1; do
		for p in $(pgrep -x dysco); do
			echo "$p $(tr '\0' ' ' </proc/"$p"/cmdline 2>/dev/null | sed -n 's/.*agent.*--name \([^ ]*\).*/\1/p')"
		done
	done
) >"$out/pids" 2>/dev/null &
bin/dysco-bench --only reconfig --reconfig-reps 1 --reconfig-open-rate 50 --dysco "$BIN" --out "$out/res" >/dev/null 2>"$out/bench"
kill -INT "$bt"
wait "$bt" || true
bt=
grep -o 'per session, the time.*median phases at the left anchor: [^;]*' "$out/bench" | sed 's/.*succeeded; /benchmark (traced): /' || true

python3 - "$out" <<'EOF'
import collections, statistics, sys
d = sys.argv[1]
host = {}
for line in open(d + "/pids"):
    f = line.split()
    if len(f) == 2:
        host[int(f[0])] = f[1]
names = {1: "requestLock", 2: "ackLock", 3: "nackLock", 4: "cancelLock", 5: "ackCancel",
         6: "SYN", 7: "SYN-ACK", 8: "ACK", 9: "FIN", 10: "FIN-ACK"}
reqs = collections.defaultdict(list)
for line in open(d + "/bt"):
    f = line.split()
    if len(f) != 6 or not f[0].isdigit() or int(f[1]) not in host:
        continue
    reqs[int(f[5])].append((int(f[0]), host[int(f[1])], f[2], names.get(int(f[3]), f[3])))

def nth(ev, who, way, typ, n=0):
    for e in ev:
        if e[1:] == (who, way, typ):
            if n == 0:
                return e[0]
            n -= 1
    return None

# The messages on one removal's critical path, in the order they happen
# (the proxy is the middle agent of the old path; the new path joins client
# and server directly). The new path's SYN goes beside requestLock
# (docs/protocol.md, "The early SYN of a direct new path"), off that path.
# The server's answer to it grants the lock ("The granting SYN-ACK"): the
# client goes on with whichever of the SYN-ACK (one hop) and the ackLock
# (two hops, back through the proxy) reaches it first, so the critical path
# takes one branch or the other. FINs and FIN-ACKs go twice (new path and
# old path).
lock = [("client", "S", "requestLock"), ("proxy", "R", "requestLock"), ("proxy", "S", "requestLock"),
        ("server", "R", "requestLock")]
by_synack = [("server", "S", "SYN-ACK"), ("client", "R", "SYN-ACK")]
by_acklock = [("server", "S", "ackLock"), ("proxy", "R", "ackLock"), ("proxy", "S", "ackLock"),
              ("client", "R", "ackLock")]
tail = [("client", "S", "ACK"), ("server", "R", "ACK"), ("server", "S", "FIN")]
steps = collections.defaultdict(list)
n = 0
granted = collections.Counter()
for ev in reqs.values():
    ev.sort()
    sa, al = nth(ev, "client", "R", "SYN-ACK"), nth(ev, "client", "R", "ackLock")
    if sa is not None and (al is None or sa < al):
        seq, how = lock + by_synack + tail, "SYN-ACK"
    else:
        seq, how = lock + by_acklock + tail, "ackLock"
    ts = [nth(ev, *s) for s in seq]
    if None in ts:
        continue
    n += 1
    granted[how] += 1
    for i in range(1, len(seq)):
        steps[(seq[i - 1], seq[i])].append(ts[i] - ts[i - 1])
    t_ack = ts[seq.index(("client", "S", "ACK"))]
    extra = {
        "early SYN: client's requestLock to its SYN": (nth(ev, "client", "S", "SYN"), ts[0]),
        "early SYN: hop client → server": (nth(ev, "server", "R", "SYN"), nth(ev, "client", "S", "SYN")),
        "server: its ackLock to its SYN-ACK": (nth(ev, "server", "S", "SYN-ACK"), nth(ev, "server", "S", "ackLock")),
        "client: the SYN-ACK arrives before the ackLock by": (al, sa),
        "server: FIN's 2nd copy after its 1st": (nth(ev, "server", "S", "FIN", 1), ts[-1]),
        "client: its ACK to its first FIN": (nth(ev, "client", "S", "FIN"), t_ack),
        "client: server's FIN arrives after the ACK left": (nth(ev, "client", "R", "FIN"), t_ack),
    }
    fa, ra = nth(ev, "client", "S", "FIN-ACK"), nth(ev, "client", "R", "FIN-ACK")
    if fa and ra:
        extra["client: ACK to completion (last FIN-ACK)"] = (max(fa, ra), t_ack)
        steps["whole: requestLock to completion"].append(max(fa, ra) - ts[0])
    for k, (x, y) in extra.items():
        if x is not None and y is not None:
            steps[k].append(x - y)

def row(name, v):
    v = sorted(x / 1e3 for x in v)
    print("| %s | %.0f | %.0f | %.0f |" % (name, statistics.median(v), v[len(v) // 4], v[len(v) * 3 // 4]))

print("\n%d removals with every step traced; the client went on with the SYN-ACK in %d, "
      "with the ackLock in %d (rows of a branch count only its removals)\n"
      % (n, granted["SYN-ACK"], granted["ackLock"]))
print("| step | p50 µs | p25 | p75 |\n|---|---|---|---|")
for k, v in steps.items():
    if isinstance(k, tuple):
        (a, b) = k
        kind = "handling" if a[0] == b[0] else "hop"
        row("%s: %s %s → %s %s" % (kind, a[0], a[2], b[0], b[2]), v)
    else:
        row(k, v)
EOF
