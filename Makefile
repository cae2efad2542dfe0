# Dysco: `make demo` runs the main lab scenario, `make test` runs every test.
# Both install what they need (Debian packages, Go modules) by themselves.

GO ?= go
BIN := bin/dysco
# dysco-h3: the HTTP/3 client and server of the UDP tests (docs/lab.md), in
# its own Go module (test/h3) so that the product does not depend on quic-go.
H3BIN := bin/dysco-h3
export CGO_ENABLED := 1

.PHONY: all build h3 etcd kube deps generate check-generate vet test demo bench soak soak-e2e verify fuzz clean lab-clean

all: build

deps:
	@scripts/deps.sh

build: deps lib/libdysco.so h3 etcd kube
	$(GO) build -o $(BIN) ./cmd/dysco
	$(GO) build -tags kubernetes -o bin/dysco-kube ./cmd/dysco

h3:
	$(GO) build -C test/h3 -o ../../$(H3BIN) .

# etcd and etcdctl: the real etcd of the etcd backend's tests (docs/etcd.md),
# built from Go modules in their own module (test/etcd).
etcd:
	$(GO) build -C test/etcd -o ../../bin/etcd .
	$(GO) build -C test/etcd -o ../../bin/etcdctl go.etcd.io/etcd/etcdctl/v3

# kube-apiserver: the real API server of the envtest-based tests, built from
# Go modules in their own module (test/kube; its go.mod tells why the staging
# modules are replaced). The build takes minutes, so the binary is kept in
# .cache/kube/KEY/, KEY a hash of the modules kube-apiserver is built from
# (with their versions), the Go version and the link flags, and
# bin/kube-apiserver is a link to it: while none of these change (the
# module's tests may add modules of their own), `make kube` only checks
# that the binary is there.
# The link flags stamp the version that a release build has (--version).
KUBE_CACHE := .cache/kube
kube:
	@set -e; \
	ver=$$(awk '$$1 == "k8s.io/kubernetes" { print $$2 }' test/kube/go.mod); \
	test -n "$$ver" || { echo "kube: no k8s.io/kubernetes in test/kube/go.mod"; exit 1; }; \
	major=$${ver#v}; major=$${major%%.*}; minor=$${ver#v$$major.}; minor=$${minor%%.*}; \
	ldflags="-s -w"; \
	for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do \
	  ldflags="$$ldflags -X $$p.gitVersion=$$ver -X $$p.gitMajor=$$major -X $$p.gitMinor=$$minor"; \
	done; \
	mods=$$($(GO) list -C test/kube -deps -f '{{with .Module}}{{.Path}} {{.Version}}{{with .Replace}} => {{.Path}} {{.Version}}{{end}}{{end}}' k8s.io/kubernetes/cmd/kube-apiserver | sort -u); \
	key=$$({ echo "$$mods"; $(GO) env GOVERSION; echo "$$ldflags"; } | sha256sum | cut -c1-16); \
	dir=$(KUBE_CACHE)/$$key; \
	if [ ! -x $$dir/kube-apiserver ]; then \
	  echo "kube: building kube-apiserver $$ver into $$dir (takes minutes)"; \
	  mkdir -p $$dir; \
	  CGO_ENABLED=0 $(GO) build -C test/kube -ldflags "$$ldflags" \
	    -o ../../$$dir/kube-apiserver.$$$$.tmp k8s.io/kubernetes/cmd/kube-apiserver; \
	  mv -f $$dir/kube-apiserver.$$$$.tmp $$dir/kube-apiserver; \
	  find $(KUBE_CACHE) -mindepth 1 -maxdepth 1 ! -name $$key -exec rm -rf {} +; \
	fi; \
	mkdir -p bin; \
	ln -sfn ../$$dir/kube-apiserver bin/kube-apiserver

# libdysco: the proxy-side library (docs/libdysco.md), for LD_PRELOAD or -ldysco.
# Built under a temporary name and renamed: test packages running in parallel
# may build it at the same time.
LIBDYSCO_SRC := $(wildcard libdysco/*.c)
lib/libdysco.so: $(LIBDYSCO_SRC) $(wildcard libdysco/*.h) include/dysco.h
	@mkdir -p lib
	$(CC) -O2 -Wall -Wextra -Werror -fPIC -shared -Iinclude -o $@.$$$$.tmp $(LIBDYSCO_SRC) -ldl -lpthread && mv -f $@.$$$$.tmp $@

# Regenerate the committed eBPF objects and the C wire header.
generate: deps
	$(GO) generate ./internal/wire ./internal/datapath

# CI: regeneration must give no diff.
check-generate: generate
	@git diff --exit-code -- bpf internal/datapath internal/wire || \
	  { echo "generated files differ from the committed ones: run 'make generate' and commit"; exit 1; }

vet:
	$(GO) vet ./...
	cd test/h3 && $(GO) vet ./...
	cd test/etcd && $(GO) vet ./...
	cd test/kube && $(GO) vet ./...
	$(GO) vet -tags kubernetes ./internal/policyserver
	cd test/kubestore && $(GO) vet -tags kubernetes ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go' | grep -v '_bpfel.go$$'))" || { gofmt -l .; echo "gofmt needed"; exit 1; }

# The end-to-end package is the long pole: its tests run in two processes
# at once (E2E_SHARD and the rest), beside the other packages; the
# benchmark and experiment runners, whose measurements (a baseline's UDP
# loss) need the cores, run after them.
E2E_SHARD := ^Test(A|B|C|E|F|K|L|M|N|O|P)
ALONE := /internal/bench$$|/internal/experiment$$

test: build check-generate vet lab-clean
	@pkgs=$$($(GO) list ./... | grep -v -E '/test/e2e$$|$(ALONE)'); \
	$(GO) test -count=1 -timeout 25m -p 1 $$pkgs & p0=$$!; \
	$(GO) test -count=1 -timeout 25m -run '$(E2E_SHARD)' ./test/e2e & p1=$$!; \
	$(GO) test -count=1 -timeout 25m -skip '$(E2E_SHARD)' ./test/e2e & p2=$$!; \
	s=0; for p in $$p0 $$p1 $$p2; do wait $$p || s=1; done; \
	$(GO) test -count=1 -timeout 25m -p 1 $$($(GO) list ./... | grep -E '$(ALONE)') || s=1; \
	exit $$s
	cd test/h3 && $(GO) test -count=1 ./...
	cd test/kube && $(GO) test -count=1 ./...
	cd test/kubestore && $(GO) test -count=1 -tags kubernetes ./...
	@$(MAKE) --no-print-directory lab-clean
	model/verify.sh --quick

demo: build
	scripts/demo.sh

bench: build
	scripts/bench.sh

# Every Spin configuration of the protocol model, exhaustively (docs/verification.md),
# and the simulation of the Go protocol core.
verify: deps
	model/verify.sh
	$(GO) test -count=1 -run Sim ./internal/protocol/sim

# The reconfiguration protocol's simulation over many seeds (make soak SEEDS=1000000).
SEEDS ?= 100000
soak:
	$(GO) test -count=1 -timeout 0 -run Sim ./internal/protocol/sim -seeds $(SEEDS)

# Live reconfiguration under churn in a lab (dysco lab run churn,
# docs/experiments.md): random rounds on HTTP, bulk and short sessions that
# come and go; fails on any reset, failed transfer or stuck phase. The quick
# size by default (a few minutes); make soak-e2e DURATION=2h for as long as
# asked. Report, plot and data in SOAK_OUT.
DURATION ?=
SOAK_OUT ?= out/soak-e2e
soak-e2e: build
	$(BIN) lab run churn $(if $(DURATION),--duration $(DURATION),--quick) --out $(SOAK_OUT)

# Every fuzz target for FUZZTIME each, one after another: the Go targets
# (go test -fuzz; make test runs their seed corpora) and libdysco's
# libFuzzer harness. make fuzz FUZZTIME=10m for longer.
FUZZTIME ?= 30s
fuzz: build
	scripts/fuzz.sh $(FUZZTIME)

# Remove lab namespaces left by an interrupted run.
lab-clean:
	@-$(BIN) lab down --all >/dev/null 2>&1 || true

clean:
	rm -rf bin lib
