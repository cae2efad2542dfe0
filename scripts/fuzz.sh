#!/usr/bin/env bash
# Runs every fuzz target for FUZZTIME each, one after another (make fuzz):
# each Go target (func FuzzXxx in a _test.go file) with go test -fuzz,
# then libdysco's libFuzzer harness (libdysco/fuzz). The datapath's and the
# agent's targets need root. A crash stops the run: Go writes the input
# under the package's testdata/fuzz/FuzzXxx/ (add it to the repository with
# the fix, where go test then runs it every time); libFuzzer writes
# crash-* in the current directory (copy it to libdysco/fuzz/corpus/).
#
#   scripts/fuzz.sh [FUZZTIME]      # default 30s; Go's syntax (30s, 5m, 1h)
#   FUZZ_ONLY=FuzzLocalAPI scripts/fuzz.sh 1m   # one target (a regexp)
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${1:-${FUZZTIME:-30s}}
only=${FUZZ_ONLY:-.}

seconds() { # 30s, 5m, 1h, 1h30m -> seconds, for libFuzzer
  local t=$1 total=0 n
  while [[ $t =~ ^([0-9]+)([smh])(.*)$ ]]; do
    n=${BASH_REMATCH[1]}
    case ${BASH_REMATCH[2]} in s) total=$((total + n)) ;; m) total=$((total + 60 * n)) ;; h) total=$((total + 3600 * n)) ;; esac
    t=${BASH_REMATCH[3]}
  done
  [ -z "$t" ] || { echo "fuzz: FUZZTIME=$1: use s, m or h (30s, 5m, 1h)" >&2; exit 2; }
  echo "$total"
}
secs=$(seconds "$fuzztime")

# Every Go target: package directory and name.
mapfile -t targets < <(grep -rn --include='*_test.go' -E '^func Fuzz[A-Za-z0-9_]*\(f \*testing\.F\)' internal test cmd 2>/dev/null |
  sed -E 's#^([^:]*)/[^/:]*:[0-9]+:func (Fuzz[A-Za-z0-9_]*)\(.*#\1 \2#' | sort)
for t in "${targets[@]}"; do
  read -r dir name <<<"$t"
  [[ $name =~ $only ]] || continue
  echo "== $name ($dir) for $fuzztime"
  go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" -parallel 1 "./$dir"
done

# libdysco: parse_answer under libFuzzer, AddressSanitizer and UBSan. New
# inputs go to a scratch directory; the repository's corpus is read only.
if [[ answer =~ $only || FuzzLibdyscoAnswer =~ $only ]]; then
  echo "== libdysco answer harness for $fuzztime"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Ilibdysco -Iinclude \
    -o "$work/answer-fuzz" libdysco/fuzz/answer_fuzz.c libdysco/answer.c
  mkdir -p "$work/corpus"
  "$work/answer-fuzz" -max_total_time="$secs" -print_final_stats=1 "$work/corpus" libdysco/fuzz/corpus
fi
