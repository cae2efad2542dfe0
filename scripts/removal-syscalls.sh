#!/bin/bash
# removal-syscalls.sh: count the agents' system calls during one run of the
# proxy-removal benchmark (600 sessions, `bench --only reconfig`), per
# removal, with the bpf calls by command and map (BENCHMARKS.md, "System
# calls per proxy removal"). For comparing agent builds.
#
#   scripts/removal-syscalls.sh [BINARY]     (root, bpftrace; default bin/dysco)
#
# BINARY must be named "dysco" (bpftrace picks the agents by command name):
# copy another build to a directory of its own, e.g. /tmp/old/dysco. The
# counts cover the benchmark's whole run (lab set-up, dialling, the removals,
# the checks after them), divided by the 600 removals.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-bin/dysco}
[ "$(id -u)" = 0 ] || { echo "removal-syscalls.sh: needs root" >&2; exit 1; }
[ -x "$BIN" ] || { echo "removal-syscalls.sh: no binary $BIN (make build)" >&2; exit 1; }
[ "$(basename "$BIN")" = dysco ] || { echo "removal-syscalls.sh: the binary must be named dysco, got $BIN" >&2; exit 1; }
command -v bpftrace >/dev/null || { echo "removal-syscalls.sh: needs bpftrace" >&2; exit 1; }
command -v bpftool >/dev/null || { echo "removal-syscalls.sh: needs bpftool" >&2; exit 1; }
N=600
out=$(mktemp -d /tmp/removal-syscalls.XXXXXX)
bt=
cleanup() {
	[ -n "$bt" ] && kill -INT "$bt" 2>/dev/null || true
	jobs -p | xargs -r kill 2>/dev/null || true
	rm -rf "$out"
}
trap cleanup EXIT
go build -o bin/dysco-bench ./bench

bpftrace -e '
tracepoint:syscalls:sys_enter_bpf /comm == "dysco"/ { @bpf[pid, args->cmd, *(uint32 *)uptr(args->uattr)] = count(); }
tracepoint:raw_syscalls:sys_enter /comm == "dysco"/ { @nr[pid, args->id] = count(); }' >"$out/bt" 2>&1 &
bt=$!
for _ in $(seq 100); do grep -q Attaching "$out/bt" && break; sleep 0.1; done
grep -q Attaching "$out/bt" || { echo "removal-syscalls.sh: bpftrace did not start:" >&2; cat "$out/bt" >&2; exit 1; }
# Which map each agent's descriptors are (the first field of a map
# command's attributes is the map's descriptor), sampled while the lab runs.
(
	while sleep 1; do
		for p in $(pgrep -x dysco); do
			echo "$p role $(tr '\0' ' ' </proc/"$p"/cmdline 2>/dev/null | sed -n 's/.*--name \([^ ]*\).*/\1/p')"
			for fd in /proc/"$p"/fd/*; do
				case "$(readlink "$fd" 2>/dev/null)" in *bpf-map*) ;; *) continue ;; esac
				id=$(awk '/map_id/ {print $2}' /proc/"$p"/fdinfo/"${fd##*/}" 2>/dev/null) || continue
				name=$(bpftool map show id "$id" 2>/dev/null | awk 'NR == 1 {print $4}')
				[ -n "$name" ] && echo "$p ${fd##*/} $name"
			done
		done
	done >"$out/fds" 2>/dev/null
) &
bin/dysco-bench --only reconfig --reconfig-reps 1 --dysco "$BIN" --markdown - >"$out/md" 2>&1
kill -INT "$bt"
wait "$bt" || true
bt=
grep -o "per repetition p50/p99 ms [0-9./]*\|agents. CPU meanwhile[^)]*" "$out/md" || { echo "removal-syscalls.sh: the benchmark gave no result:" >&2; tail "$out/md" >&2; exit 1; }
python3 - "$out" "$N" <<'EOF'
import collections, re, sys
out, n = sys.argv[1], int(sys.argv[2])
names, roles = collections.defaultdict(dict), {}
for l in open(out + "/fds"):
    f = l.split()
    if len(f) == 3 and f[1] == "role":
        roles[int(f[0])] = f[2]
    elif len(f) == 3:
        names[int(f[0])][int(f[1])] = f[2].removeprefix("dysco_")
cmds = {1: "lookup", 2: "update", 3: "delete", 4: "next_key", 10: "prog_run", 24: "batch_lookup"}
scs = {321: "bpf", 14: "rt_sigprocmask", 281: "epoll_pwait", 202: "futex", 35: "nanosleep",
       44: "sendto", 45: "recvfrom", 0: "read", 1: "write"}
total, bpf = collections.Counter(), collections.defaultdict(collections.Counter)
bynr = collections.defaultdict(collections.Counter)
for l in open(out + "/bt"):
    m = re.match(r"@nr\[(\d+), (\d+)\]: (\d+)", l)
    if m:
        pid, nr, c = map(int, m.groups())
        total[pid] += c
        bynr[pid][scs.get(nr, str(nr))] += c
    m = re.match(r"@bpf\[(\d+), (\d+), (\d+)\]: (\d+)", l)
    if m:
        pid, cmd, fd, c = map(int, m.groups())
        what = cmds.get(cmd, str(cmd))
        if cmd in (1, 2, 3, 4, 24):
            what += " " + names[pid].get(fd, "fd%d" % fd)
        bpf[pid][what] += c
for pid in sorted(total, key=lambda p: -total[p])[:3]:
    role = roles.get(pid, str(pid))
    print("%s: %.0f system calls per removal; %s" % (role, total[pid] / n,
          ", ".join("%s %.1f" % (k, v / n) for k, v in bynr[pid].most_common(8))))
    print("  bpf: " + ", ".join("%s %.1f" % (k, v / n) for k, v in bpf[pid].most_common(12)))
EOF
