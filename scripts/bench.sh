#!/usr/bin/env bash
# make bench: Dysco against a plain-routing baseline, side by side in one run
# (see BENCHMARKS.md). Builds the runner (bench/) and runs it; arguments go to
# the runner, e.g. `scripts/bench.sh --quick` or `--only goodput,memory`.
# Needs root and bin/dysco (`make build`). Writes out/bench/*.json and, for
# full runs, the results section of BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "bench: needs root (network namespaces, eBPF)" >&2
  exit 1
fi
if [ ! -x bin/dysco ]; then
  echo "bench: bin/dysco is missing: run 'make build' first" >&2
  exit 1
fi
export CGO_ENABLED="${CGO_ENABLED:-1}"
go build -o bin/dysco-bench ./bench
# exec: Ctrl-C reaches the runner directly, which tears its labs down.
exec bin/dysco-bench "$@"
