#!/usr/bin/env bash
# Installs what building, testing and the demo need, from Debian's packages.
# Idempotent: only missing packages are installed; apt-get update runs once.
# dnsmasq-base is the dnsmasq binary alone: unlike the dnsmasq package it
# installs no service, so nothing starts a resolver on the host's port 53;
# the tests run their own dnsmasq inside lab namespaces.
set -euo pipefail
pkgs=(
  clang llvm libbpf-dev libpcap-dev linux-libc-dev   # datapath build, libpcap for policy filters
  iproute2 iptables conntrack ethtool util-linux     # lab and middleboxes
  nginx-light iperf3 curl tcpdump wrk haproxy        # real programs in tests, demo, benchmarks
  dnsmasq-base bind9-dnsutils                        # UDP tests: a DNS server and dig
  spin                                               # protocol model checking
  libclang-rt-dev                                    # make fuzz: libFuzzer and sanitizers (libdysco's harness)
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "deps: missing packages: ${missing[*]}; run as root (or install them) and retry" >&2
    exit 1
  fi
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Kernel facilities the lab needs: a bpffs for pinned datapaths.
if [ "$(id -u)" -eq 0 ] && [ "$(stat -f -c %T /sys/fs/bpf 2>/dev/null)" != "bpf_fs" ]; then
  mount -t bpf bpf /sys/fs/bpf
fi
