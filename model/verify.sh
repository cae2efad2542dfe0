#!/usr/bin/env bash
# Verify the Promela model of the reconfiguration protocol with Spin.
#
#   model/verify.sh            every configuration (hours on 2 cores since the
#                              fins' copies; some searches need 8 GB and more)
#   model/verify.sh --quick    a subset (under a minute), for make test
#   model/verify.sh --broken   only the deliberately broken variants (must fail)
#   model/verify.sh NAME...    the named configurations
#
# Environment: JOBS (searches at a time, 2), OPT (cc optimisation, -O2; -O0
# for --quick), DEPTH (pan -m, 20000).
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
# Control-message loss: -DLOSS=N lets the network lose up to N control
# messages in a run, and -DMAXTRIES the number of sends before a sender
# gives up (agent.pml). Broken variants must produce an error, whose trail
# is written to model/trails/NAME.txt; the script fails if they do not.
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
	"delete2|-DDELETE2|ok"
	"contend|-DCONTEND|ok"
	"contend-same-anchor|-DCONTEND_SAME|ok"
	"contend-nested|-DCONTEND_NESTED|ok"
	"cancel|-DCANCEL|ok"
	"cancel-replace|-DCANCEL_REPLACE|ok"
	"delete-fin|-DDELETE -DFINS=1 -DQS=10|ok"
	"insert-fin|-DINSERT -DFINS=1|ok"
	"delete-delta-fin|-DDELETE_DELTA -DFINS=1 -DQS=10|ok"
	"insert-2x1|-DINSERT -DNDR=2 -DNDL=1|ok"
	"cancel-fin|-DCANCEL -DFINS=1 -DNDR=2|ok"
	"insert2|-DINSERT2|ok"
	"replace2by1|-DREPLACE2BY1|ok"
	"insert-right|-DINSERT_RIGHT|ok"
	"replace-fin|-DREPLACE -DFINS=1|ok"
	"contend-fin|-DCONTEND -DFINS=1 -DQS=10|ok"
	# loss of control messages (agent.pml: at most LOSS lost, MAXTRIES sends;
	# a control message sent to a full channel is dropped, as a network
	# would, docs/verification.md "Channel overflow").
	"delete-loss|-DDELETE -DLOSS=1|ok"
	"insert-loss|-DINSERT -DLOSS=1|ok"
	"replace-loss|-DREPLACE -DLOSS=1|ok"
	"delete2-loss|-DDELETE2 -DLOSS=1|ok"
	"contend-loss|-DCONTEND -DLOSS=1|ok"
	"contend-same-anchor-loss|-DCONTEND_SAME -DLOSS=1|ok"
	"contend-nested-loss|-DCONTEND_NESTED -DLOSS=1|ok"
	"cancel-loss|-DCANCEL -DLOSS=1|ok"
	"cancel-replace-loss|-DCANCEL_REPLACE -DLOSS=1|ok"
	"insert-fin-loss|-DINSERT -DFINS=1 -DLOSS=1|ok"
	"delete-fin-loss|-DDELETE -DFINS=1 -DLOSS=1|ok"
	"replace-fin-loss|-DREPLACE -DFINS=1 -DLOSS=1|ok"
	"cancel-fin-loss|-DCANCEL -DFINS=1 -DNDR=2 -DLOSS=1|ok"
	"delete-dup|-DDELETE -DLOSS=1 -DMAXTRIES=3|ok"
	"insert-dup|-DINSERT -DLOSS=1 -DMAXTRIES=3|ok"
	"contend-dup|-DCONTEND -DLOSS=1 -DMAXTRIES=3|ok"
	"cancel-dup|-DCANCEL -DLOSS=1 -DMAXTRIES=3|ok"
	"delete-loss2|-DDELETE -DLOSS=2|ok"
	"insert-loss2|-DINSERT -DLOSS=2|ok"
	"replace-loss2|-DREPLACE -DLOSS=2|ok"
	"insert-fin-loss2|-DINSERT -DFINS=1 -DLOSS=2|ok"
	"delete-fin-loss2|-DDELETE -DFINS=1 -DLOSS=2|ok"
	"delete-loss2-dup|-DDELETE -DLOSS=2 -DMAXTRIES=3|ok"
	"insert-loss2-dup|-DINSERT -DLOSS=2 -DMAXTRIES=3|ok"
	"delete-giveup|-DDELETE -DLOSS=1 -DMAXTRIES=1|ok"
	"insert-giveup|-DINSERT -DLOSS=1 -DMAXTRIES=1|ok"
	"cancel-giveup|-DCANCEL -DLOSS=1 -DMAXTRIES=1|ok"
	"contend-giveup|-DCONTEND -DLOSS=1 -DMAXTRIES=1|ok"
	# two losses with MAXTRIES 1: a lost probe or tomb answer, both anchors
	# giving up on their fins, a waiting anchor giving up on its probes
	"delete-giveup2|-DDELETE -DLOSS=2 -DMAXTRIES=1|ok"
	# a host on both paths (docs/verification.md, "A middlebox on both
	# paths: the model"): the new chain equals the old segment (unchanged),
	# crosses it (refused by the left anchor), names a host of the session's
	# path outside the segment (refused by that host), a delete of nothing,
	# a partial ackLock list, a middlebox of an old path joining a new one
	# as the old path is torn down, and a datapath refusing a join
	"onpath-same|-DONPATH_SAME|ok"
	"onpath-same2|-DONPATH_SAME2|ok"
	"onpath-partial|-DONPATH_SAME2 -DMAXLIST=1|ok"
	"onpath-cross|-DONPATH_CROSS|ok"
	"onpath-reorder|-DONPATH_REORDER|ok"
	"onpath-outside|-DONPATH_OUTSIDE|ok"
	"onpath-none|-DONPATH_NONE|ok"
	"onpath-same-fin|-DONPATH_SAME -DFINS=1|ok"
	"onpath-outside2|-DONPATH_OUTSIDE2|ok"
	"onpath-outside-fin|-DONPATH_OUTSIDE -DFINS=1|ok"
	"onpath-same-loss|-DONPATH_SAME -DLOSS=1|ok"
	"onpath-same2-loss|-DONPATH_SAME2 -DLOSS=1|ok"
	"onpath-outside-loss|-DONPATH_OUTSIDE -DLOSS=1|ok"
	"onpath-outside-dup|-DONPATH_OUTSIDE -DLOSS=1 -DMAXTRIES=3|ok"
	"onpath-outside-loss2|-DONPATH_OUTSIDE -DLOSS=2|ok"
	"onpath-same-giveup|-DONPATH_SAME -DLOSS=1 -DMAXTRIES=1|ok"
	"onpath-outside-giveup|-DONPATH_OUTSIDE -DLOSS=1 -DMAXTRIES=1|ok"
	"rejoin|-DREJOIN|ok"
	"rejoin-any|-DREJOIN -DREJOIN_ANY|ok"
	# a loss without TCP data: a lost fin leaves 1 on r1's live path when
	# r2's SYN comes (1 refuses); with data, and with FINs, the two after it
	# do not complete in 11 GB (docs/verification.md)
	"rejoin-loss-nodata|-DREJOIN -DLOSS=1 -DNDR=0 -DNDL=0|ok"
	"rejoin-giveup-nodata|-DREJOIN -DLOSS=1 -DMAXTRIES=1 -DNDR=0 -DNDL=0|ok"
	"rejoin-fin|-DREJOIN -DFINS=1|ok"
	"rejoin-loss|-DREJOIN -DLOSS=1|ok"
	"join-failed|-DINSERT2 -DJOINFAIL=1|ok"
	"join-failed-fin|-DINSERT2 -DJOINFAIL=1 -DFINS=1|ok"
	# a JoinFailed whose refusal is lost: the SYN sent again is refused
	# again (docs/verification.md, "JoinFailed with its refusal lost")
	"join-failed-loss|-DINSERT2 -DJOINFAIL=1 -DLOSS=1|ok"
	# a proxy's splice: middlebox 1 triggers its left neighbour 0 to delete
	# it (docs/verification.md, "Triggers"); with a loss, and with copies
	# (with data, a loss takes 37 M states and 7 GB, as delete-loss; the
	# trigger's own exchanges are checked without data)
	"trigger|-DTRIGGER|ok"
	"trigger-loss|-DTRIGGER -DLOSS=1|ok"
	"trigger-loss-nodata|-DTRIGGER -DLOSS=1 -DNDR=0 -DNDL=0|ok"
	# a state migration replacing 1 by 2 (docs/verification.md, "State
	# migration"): loss-free, order-preserving, each with a loss
	"migrate|-DMIGRATE|ok"
	"migrate-order|-DMIGRATE -DMIG_ORDER|ok"
	"migrate-loss|-DMIGRATE -DLOSS=1|ok"
	"migrate-order-loss|-DMIGRATE -DMIG_ORDER -DLOSS=1|ok"
	# UDP sessions (docs/verification.md, "UDP sessions"): datagrams both
	# ways, the two-path phase for datagrams; an anchor ends its side only
	# once the old path holds no datagram (the drain-time assumption)
	"udp-delete|-DDELETE -DUDP|ok"
	"udp-insert|-DINSERT -DUDP|ok"
	"udp-replace|-DREPLACE -DUDP|ok"
	"udp-delete2|-DDELETE2 -DUDP|ok"
	"udp-delete-2x2|-DDELETE -DUDP -DNDR=2 -DNDL=2|ok"
	"udp-contend|-DCONTEND -DUDP|ok"
	"udp-delete-loss|-DDELETE -DUDP -DLOSS=1|ok"
	"udp-insert-loss|-DINSERT -DUDP -DLOSS=1|ok"
	"udp-delete-giveup|-DDELETE -DUDP -DLOSS=1 -DMAXTRIES=1|ok"
	# rebinds (docs/verification.md, "Rebinds"): the first agent moves its
	# right subsession, the last its left one: alone, with a loss, with
	# copies (MAXTRIES 3), giving up (MAXTRIES 1: the agent asks again),
	# with every answer of both attempts lost, with answers slower than the
	# mover's timer (RB_SLOW); concurrently with a delete whose right anchor
	# is the mover (contend) or whose left anchor is (contend-right),
	# without data when slow or with a loss
	"rebind-right|-DREBIND_RIGHT|ok"
	"rebind-left|-DREBIND_LEFT|ok"
	"rebind-right-loss|-DREBIND_RIGHT -DLOSS=1|ok"
	"rebind-left-loss|-DREBIND_LEFT -DLOSS=1|ok"
	"rebind-right-dup|-DREBIND_RIGHT -DLOSS=1 -DMAXTRIES=3|ok"
	"rebind-left-dup|-DREBIND_LEFT -DLOSS=1 -DMAXTRIES=3|ok"
	"rebind-right-giveup|-DREBIND_RIGHT -DLOSS=1 -DMAXTRIES=1|ok"
	"rebind-left-giveup|-DREBIND_LEFT -DLOSS=1 -DMAXTRIES=1|ok"
	"rebind-right-giveup2|-DREBIND_RIGHT -DLOSS=2 -DMAXTRIES=1|ok"
	"rebind-right-slow|-DREBIND_RIGHT -DRB_SLOW|ok"
	"rebind-left-slow|-DREBIND_LEFT -DRB_SLOW|ok"
	"rebind-contend|-DREBIND_CONTEND|ok"
	"rebind-contend-right|-DREBIND_CONTEND_RIGHT|ok"
	"rebind-contend-slow|-DREBIND_CONTEND -DRB_SLOW -DNDR=0 -DNDL=0|ok"
	"rebind-contend-right-slow|-DREBIND_CONTEND_RIGHT -DRB_SLOW -DNDR=0 -DNDL=0|ok"
	"rebind-contend-loss|-DREBIND_CONTEND -DLOSS=1 -DNDR=0 -DNDL=0|ok"
	"rebind-contend-right-loss|-DREBIND_CONTEND_RIGHT -DLOSS=1 -DNDR=0 -DNDL=0|ok"
	"rebind-contend-giveup|-DREBIND_CONTEND -DLOSS=1 -DMAXTRIES=1 -DNDR=0 -DNDL=0|ok"
	"rebind-contend-right-giveup|-DREBIND_CONTEND_RIGHT -DLOSS=1 -DMAXTRIES=1 -DNDR=0 -DNDL=0|ok"
	# the deliberately broken variants must fail
	"broken-skip-lock|-DCONTEND -DBROKEN_SKIP_LOCK|error"
	"broken-acks-old|-DDELETE -DBROKEN_ACKS_OLD|error"
	"broken-no-dedup|-DDELETE -DLOSS=1 -DBROKEN_NO_DEDUP|error"
	"broken-fin-no-reanswer|-DDELETE -DLOSS=1 -DBROKEN_FIN_NO_REANSWER|error"
	"broken-no-probe|-DREPLACE -DLOSS=1 -DMAXTRIES=1 -DBROKEN_NO_PROBE|error"
	# the old behaviour (no list comparison, no refusal: the host joins a
	# path of a session it carries), in and outside the segment; and a
	# refusal by a middlebox past which both fins of its old path have gone
	"broken-onpath|-DONPATH_SAME -DBROKEN_ONPATH|error"
	"broken-onpath-outside|-DONPATH_OUTSIDE -DBROKEN_ONPATH|error"
	"broken-live-known|-DREJOIN -DBROKEN_LIVE_KNOWN|error"
	# the left neighbour takes every copy of a trigger as a new one; a
	# migrating left anchor switches before the import is confirmed
	"broken-trigger-dup|-DTRIGGER -DLOSS=1 -DBROKEN_TRIGGER_DUP|error"
	"broken-mig-early-switch|-DMIGRATE -DBROKEN_MIG_EARLY_SWITCH|error"
	# a UDP anchor ends its side at its switch, without waiting for its
	# old path to drain: a datagram reaches a torn-down old path
	"broken-udp-no-quiet|-DDELETE -DUDP -DBROKEN_UDP_NO_QUIET|error"
	# rebinds: the right anchor accepts a requestLock while its left
	# subsession moves (a late rebindAck moves the new path's subsession);
	# the neighbour forgets the rebinds it refused (a copy accepted after a
	# refusal); it rejects a newer rebind naming its moved subsession (an
	# attempt after a give-up cannot recover)
	"broken-rebind-ra|-DREBIND_CONTEND -DLOSS=1 -DNDR=0 -DNDL=0 -DBROKEN_REBIND_RA|error"
	"broken-rebind-forget|-DREBIND_CONTEND -DRB_SLOW -DNDR=0 -DNDL=0 -DBROKEN_REBIND_FORGET|error"
	"broken-rebind-no-recover|-DREBIND_RIGHT -DLOSS=1 -DMAXTRIES=1 -DBROKEN_REBIND_NO_RECOVER|error"
)
QUICK="delete insert replace delete-delta delete2 contend cancel insert-fin insert-right delete-loss insert-loss cancel-loss cancel-replace-loss delete-giveup onpath-same onpath-partial onpath-reorder onpath-outside onpath-none join-failed trigger trigger-loss-nodata migrate migrate-order migrate-loss migrate-order-loss udp-delete udp-insert udp-replace broken-skip-lock broken-acks-old broken-no-dedup broken-fin-no-reanswer broken-no-probe broken-onpath broken-onpath-outside broken-live-known broken-trigger-dup broken-mig-early-switch broken-udp-no-quiet rebind-right-loss rebind-contend-slow broken-rebind-ra broken-rebind-forget broken-rebind-no-recover"
BROKEN="broken-skip-lock broken-acks-old broken-no-dedup broken-fin-no-reanswer broken-no-probe broken-onpath broken-onpath-outside broken-live-known broken-trigger-dup broken-mig-early-switch broken-udp-no-quiet broken-rebind-ra broken-rebind-forget broken-rebind-no-recover"

# C optimisation of pan: -O2 (the default) makes the big searches fast,
# but compiling pan.c at -O2 takes 15-30 s; the quick set's searches take
# a second or two, so it compiles at -O0 (2 s). Override with OPT=...
OPT_DEFAULT=-O2
sel=()
case "${1:-}" in
--quick) sel=($QUICK); OPT_DEFAULT=-O0 ;;
--broken) sel=($BROKEN) ;;
"") for c in "${CONFIGS[@]}"; do sel+=("${c%%|*}"); done ;;
*) sel=("$@") ;;
esac

OPT=${OPT:-$OPT_DEFAULT}
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
	if ! spin -a $flags dysco.pml >spin.out 2>&1 || ! cc $OPT -DSAFETY -DCOLLAPSE -DVECTORSZ=2048 -o pan pan.c >cc.out 2>&1; then
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
	elif grep -q "out of memory" pan.out; then
		res="INCOMPLETE (pan out of memory)"; touch "$work/$name.fail"
	elif [ "${errs:-x}" = 0 ] && grep -q "Search not completed" pan.out; then
		# pan stopped by a signal (SIGINT, an outer timeout) prints its
		# statistics with "errors: 0" too: not a proof.
		res="INCOMPLETE (search not completed: interrupted)"; touch "$work/$name.fail"
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
echo "total wall time: $(( $(date +%s) - total_start )) s ($JOBS jobs in parallel, cc $OPT; time s = ./pan only)"
exit $fail
