#!/usr/bin/env bash
# Verify the Promela model of the reconfiguration protocol with Spin.
#
#   model/verify.sh            every configuration (a few minutes on 2 cores)
#   model/verify.sh --quick    a subset (well under 2 minutes), for make test
#   model/verify.sh --broken   only the deliberately broken variants (must fail)
#   model/verify.sh NAME...    the named configurations
#
# Every run is an exhaustive safety search: spin -a, cc -DSAFETY (assertions
# and invalid end states; no never claim; -DCOLLAPSE: lossless state
# compression), ./pan -m<depth> with a depth limit
# far above the depth reached (the script fails if pan reports that the limit
# was hit, so no search is truncated), no bitstate, no -DMA compression.
# Liveness: every execution of the model is finite (finite data, MAXTRIES
# retransmissions), so "eventually completes" is checked as a safety
# property: in every quiescent state (timeout) init's finalCheck asserts that
# each request is resolved as expected, and any other end state is reported
# as an invalid end state.
#
# The broken variants must produce an error; the script fails if they do not.
# Exit status non-zero on any unexpected result.
set -u
cd "$(dirname "$0")"
MODEL=$(pwd)

# name | -D flags | expected (ok / error)
CONFIGS=(
	"delete|-DDELETE|ok"
	"insert|-DINSERT|ok"
	"replace|-DREPLACE|ok"
	"delete-delta|-DDELETE_DELTA|ok"
	"contend|-DCONTEND|ok"
	"contend-same-anchor|-DCONTEND_SAME|ok"
	"cancel|-DCANCEL|ok"
	"delete-fin|-DDELETE -DFINS=1|ok"
	"insert-fin|-DINSERT -DFINS=1|ok"
	"delete-delta-fin|-DDELETE_DELTA -DFINS=1|ok"
	"insert-2x1|-DINSERT -DNDR=2 -DNDL=1|ok"
	"cancel-fin|-DCANCEL -DFINS=1 -DNDR=2|ok"
	"insert2|-DINSERT2|ok"
	"replace2by1|-DREPLACE2BY1|ok"
	"insert-right|-DINSERT_RIGHT|ok"
	"replace-fin|-DREPLACE -DFINS=1|ok"
	"contend-fin|-DCONTEND -DFINS=1|ok"
	"broken-skip-lock|-DCONTEND -DBROKEN_SKIP_LOCK|error"
	"broken-acks-old|-DDELETE -DBROKEN_ACKS_OLD|error"
)
QUICK="delete insert replace delete-delta contend cancel insert-fin insert-right broken-skip-lock broken-acks-old"

sel=()
case "${1:-}" in
--quick) sel=($QUICK) ;;
--broken) sel=(broken-skip-lock broken-acks-old) ;;
"") for c in "${CONFIGS[@]}"; do sel+=("${c%%|*}"); done ;;
*) sel=("$@") ;;
esac

DEPTH=${DEPTH:-20000}
JOBS=${JOBS:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# run_one NAME: build and search one configuration; writes $work/NAME.row
# (the table line) and $work/NAME.fail when the result is unexpected.
run_one() {
	local name=$1 line="" c flags expect d start end states mem errs t res what
	for c in "${CONFIGS[@]}"; do [ "${c%%|*}" = "$name" ] && line=$c; done
	if [ -z "$line" ]; then echo "unknown configuration $name" >"$work/$name.row"; touch "$work/$name.fail"; return; fi
	IFS='|' read -r _ flags expect <<<"$line"
	d="$work/$name"; mkdir -p "$d"; cp "$MODEL"/*.pml "$d"/; cd "$d" || return
	# shellcheck disable=SC2086
	if ! spin -a $flags dysco.pml >spin.out 2>&1 || ! cc -O2 -DSAFETY -DCOLLAPSE -o pan pan.c >cc.out 2>&1; then
		{ printf '%-22s %-46s %12s %10s %8s  %s\n' "$name" "$flags" - - - "BUILD FAILED"; head -20 spin.out cc.out; } >"$work/$name.row"
		touch "$work/$name.fail"; return
	fi
	start=$(date +%s.%N)
	./pan -m"$DEPTH" >pan.out 2>&1
	end=$(date +%s.%N)
	states=$(awk '/states, stored/{print $1; exit}' pan.out)
	mem=$(awk '/total actual memory usage/{print $1; exit}' pan.out)
	errs=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' pan.out | head -1)
	t=$(echo "$end - $start" | bc)
	if grep -q "max search depth too small" pan.out; then
		res="TRUNCATED (depth)"; touch "$work/$name.fail"
	elif [ "${errs:-x}" = 0 ]; then
		if [ "$expect" = ok ]; then res="ok (exhaustive, 0 errors)"; else res="UNEXPECTED: no error found"; touch "$work/$name.fail"; fi
	else
		what=$(grep -m1 -E "assertion violated|invalid end state|error" pan.out | sed 's/^pan:1: //')
		# shellcheck disable=SC2086
		spin -t $flags -c dysco.pml >trail.txt 2>&1 || true
		if [ "$expect" = error ]; then
			res="error found, as expected: $what"
			mkdir -p "$MODEL/trails"; cp trail.txt "$MODEL/trails/$name.txt"
		else
			res="FAILED: $what"; touch "$work/$name.fail"
			tail -40 trail.txt >"$work/$name.trail"
		fi
	fi
	printf '%-22s %-46s %12s %10s %8.2f  %s\n' "$name" "$flags" "${states:-?}" "${mem:-?}" "$t" "$res" >"$work/$name.row"
}

total_start=$(date +%s)
for name in "${sel[@]}"; do
	while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
	(run_one "$name") &
done
wait
fail=0
printf '%-22s %-46s %12s %10s %8s  %s\n' configuration flags states "memory MB" "time s" result
for name in "${sel[@]}"; do
	cat "$work/$name.row"
	if [ -e "$work/$name.fail" ]; then
		fail=1
		[ -e "$work/$name.trail" ] && cat "$work/$name.trail"
	fi
done
echo "total wall time: $(( $(date +%s) - total_start )) s ($JOBS jobs in parallel; time s = ./pan only)"
exit $fail
