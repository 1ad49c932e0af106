# Two commands: `make run` (set up the service + serve) and `make test` (set up everything + run
# the tests). Needs only Python 3.11 and access to the package registry.
PY      ?= python3
VENV    := .venv
HVENV   := .hermes-venv
TVENV   := .tools-venv
PYTEST_ARGS ?=
BENCH_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup setup-service client-tools npm bubblewrap e2fsprogs nginx postgresql promtool btrfs run demo lint test mutation bench bench-first-token bench-openai-first-token bench-users bench-registry bench-streams bench-sandbox bench-network bench-requests bench-kernel wrk check-config clean

# What the service needs (`make run`): .venv with requirements.txt, .hermes-venv with the CLI,
# bubblewrap for the sandbox of every Hermes process (docs/sandbox.md), e2fsprogs for home images.
setup-service: $(VENV)/.installed $(HVENV)/.installed bubblewrap e2fsprogs

# What the tests need besides (`make test`): the test tools, nginx and promtool for the deploy/
# tests, and the client generators (docs/api-description.md §Generating a client).
setup: setup-service $(VENV)/.dev-installed nginx postgresql promtool btrfs client-tools

# the pinned lock, then this package itself (pyproject.toml; editable, no other dependency:
# the lock decides the versions), which puts the `hermes-service` command into .venv/bin
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed requirements-dev.txt
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

# The Hermes CLI lives in its own venv so its dependencies never clash with ours.
$(HVENV)/.installed: requirements-hermes.txt
	$(PY) -m venv $(HVENV)
	$(HVENV)/bin/pip install -q --disable-pip-version-check -r requirements-hermes.txt
	touch $@

# The client generators, pinned: openapi-python-client in .tools-venv (tools/requirements.txt),
# openapi-typescript + typescript in tools/node_modules (tools/package-lock.json, npm ci).
client-tools: $(TVENV)/.installed tools/node_modules/.installed

$(TVENV)/.installed: tools/requirements.txt
	$(PY) -m venv $(TVENV)
	$(TVENV)/bin/pip install -q --disable-pip-version-check -r tools/requirements.txt
	touch $@

# without npm (not root, no apt) the TypeScript part of tests/e2e/test_openapi_clients.py skips
tools/node_modules/.installed: tools/package.json tools/package-lock.json | npm
	@if command -v npm >/dev/null 2>&1; then \
	  echo "npm ci in tools/ (openapi-typescript)"; \
	  cd tools && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm is not installed: the TypeScript client test will skip"; fi

# Debian's npm (with Node.js) for openapi-typescript, when npm is missing and we are root.
npm:
	$(call apt-install,command -v npm >/dev/null 2>&1,npm,the TypeScript client generator,the TypeScript client test will skip)

# A Debian package, installed when its command is missing and we are root (CI is):
# $(call apt-install,<command test>,<package>,<what for>,<what happens without it>)
apt-install = @if $(1); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(2) (Debian package) for $(3)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $(2); } >/dev/null \
	    || echo "could not install $(2): $(4)"; \
	else \
	  echo "$(2) is not installed (not root, so not installing it): $(4)"; \
	fi

# Debian's bubblewrap: without it hermes.sandbox.mode auto runs Hermes unconfined and says so
# (check-config, the start log, /health); mode bwrap refuses to start.
bubblewrap:
	$(call apt-install,command -v bwrap >/dev/null 2>&1,bubblewrap,the sandbox of Hermes processes,Hermes processes run unconfined (see check-config))
	$(call apt-install,/sbin/ldconfig -p 2>/dev/null | grep -q libseccomp.so.2,libseccomp2,the seccomp filter of every sandbox,Hermes processes run unconfined (see check-config))

# Debian's nginx for tests/e2e/test_deploy_nginx.py; without it those tests skip and say why.
nginx:
	$(call apt-install,command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ],nginx,the deploy/nginx tests,the deploy/nginx tests will skip)

# Debian's postgresql for the tests of the shared storage (tests/support/postgres.py starts a
# temporary cluster with its initdb/pg_ctl; docs/scaling.md); without it those tests skip and
# say why. (On a machine with systemd running, the package also starts a cluster on :5432.)
postgresql:
	$(call apt-install,ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1,postgresql,the shared-storage tests,the PostgreSQL tests will skip)

# Debian's prometheus package for its promtool (tests/e2e/test_deploy_prometheus.py checks and
# unit-tests deploy/prometheus/alerts.yml); without it those checks skip and say why.
# (On a machine with systemd running, the package also enables a Prometheus server on :9090.)
promtool:
	$(call apt-install,command -v promtool >/dev/null 2>&1,prometheus,the deploy/prometheus tests,the promtool checks of deploy/prometheus will skip)

# Debian's btrfs-progs for tests/e2e/test_e2e_disk.py (a btrfs with quotas in a loop file,
# made by deploy/homes-btrfs.sh, as root); without it that test skips and says why.
# Debian's e2fsprogs (mkfs.ext4, resize2fs, e2fsck) for a home image per user, the quota the
# kernel holds on a plain host as root (hermes.sandbox.quota auto/image: docs/sandbox.md §Home images).
e2fsprogs:
	$(call apt-install,[ -x /usr/sbin/mkfs.ext4 ] && [ -x /usr/sbin/resize2fs ],e2fsprogs,home images (hermes.sandbox.quota image),quota auto falls back to the watcher and the image tests skip)

btrfs:
	$(call apt-install,command -v mkfs.btrfs >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.btrfs ],btrfs-progs,the btrfs quota test,the btrfs quota test will skip)

# Debian's wrk for bench/request_cost.py (make bench-requests); not needed by make test.
wrk:
	$(call apt-install,command -v wrk >/dev/null 2>&1,wrk,bench/request_cost.py,make bench-requests cannot run)

# Serves config.yaml with .hermes-venv/bin first on PATH. If HERMES_SERVICE_API_KEY is
# unset, a development key is generated once into $(DEV_KEY) and printed that once; later
# runs say only where it is (a key on every start would end up in logs and scrollback).
DEV_KEY ?= data/dev-api-key
DEV_ENV = mkdir -p data "$$(dirname "$(DEV_KEY)")"; \
	if [ -z "$$HERMES_SERVICE_API_KEY" ]; then \
	  if [ -s "$(DEV_KEY)" ]; then \
	    echo "development API key: in $(DEV_KEY) (HERMES_SERVICE_API_KEY overrides it)"; \
	  else \
	    (umask 077; $(VENV)/bin/python -c 'import secrets; print(secrets.token_urlsafe(32))' > "$(DEV_KEY)"); \
	    echo "development API key generated into $(DEV_KEY): $$(cat "$(DEV_KEY)")"; \
	  fi; \
	  HERMES_SERVICE_API_KEY=$$(cat "$(DEV_KEY)"); \
	fi; \
	export HERMES_SERVICE_API_KEY; export PATH="$(CURDIR)/$(HVENV)/bin:$$PATH"

run: setup-service
	@$(DEV_ENV); exec $(VENV)/bin/python main.py

# `make run` with a scripted stand-in model on loopback instead of a provider (README "Try it
# without a provider"): answers labelled [demo model], the ACP runner, data in data/demo/.
# DEMO_ARGS="--port 9200" etc. are passed to main.py.
demo: setup-service
	@$(DEV_ENV); exec $(VENV)/bin/python main.py --demo $(DEMO_ARGS)

# Validate config.yaml with the same environment `make run` uses.
check-config: setup-service
	@$(DEV_ENV); $(VENV)/bin/python main.py check-config

# Lint and types (docs/testing.md §Lint and types; pyproject.toml configures both): ruff over
# the tree, mypy over the package. Seconds; any finding fails `make test` (and so CI).
lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: setup lint
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)

# Mutation testing of the security- and durability-critical modules (docs/testing.md §Mutation
# testing): mutmut module by module, then the hand-made mutants. Not part of `make test` or CI:
# ~35 min on 2 cores. MUTATION_ARGS="security hooks" runs some modules; "--hand-only" the hand ones.
MUTATION_ARGS ?=
mutation: setup
	$(VENV)/bin/python mutation/run.py $(MUTATION_ARGS)

# The runners side by side (bench/runners.py, ~3 min) and the service's overhead per CLI turn.
bench: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/runners.py $(BENCH_ARGS)
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/turn_overhead.py

# The service's own CPU per warm ACP turn beside Hermes's own CPU per turn, v1 and panel
# (docs/benchmarks.md §The service's CPU per warm turn; target <= 5 %); ~1 min.
# BENCH_ARGS="--turns 50".
bench-warm-cpu: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/warm_turn_cpu.py $(BENCH_ARGS)

# The panel's first message.delta against a bare ACP client of the same hermes acp, taken
# alternately in one run (docs/benchmarks.md §First token); ~1 min. BENCH_ARGS="--turns 50".
bench-first-token: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/first_token.py $(BENCH_ARGS)

# The OpenAI-compatible stream's first chunk against the panel's first message.delta on the
# same runner, alternately in one run (docs/benchmarks.md §First token of the OpenAI-compatible
# routes); ~1 min. BENCH_ARGS="--turns 50".
bench-openai-first-token: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/openai_first_token.py $(BENCH_ARGS)

# N panel users at once (8, 16, 32) with the shipped limits and a provider answering after 5 s
# (docs/scaling.md §Sizing a node); ~5 min, ~5 GB of warm processes at 32.
# BENCH_ARGS="--users 8,16 --delay 5".
bench-users: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/panel_users.py $(BENCH_ARGS)

# Session registry at 1 000 / 10 000 / 100 000 sessions (no CLI; ~4 min; up to ~150 MB and
# 100 000 small files in a temp folder, removed afterwards). BENCH_ARGS="--ops 200" etc.
bench-registry: setup
	$(VENV)/bin/python bench/registry_scale.py $(BENCH_ARGS)

# Event-stream fan-out: 100, 500 and 1000 subscribers on one live run (docs/mnote-client.md
# §Event-stream fan-out); ~2 minutes. BENCH_ARGS="--subscribers 1000" for one size.
bench-streams: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/stream_fanout.py $(BENCH_ARGS)

# Sandbox on (hermes.sandbox.mode: bwrap) vs off (none), side by side
# (docs/sandbox.md); ~5 minutes. BENCH_ARGS="--turns 10" for more samples.
bench-sandbox: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/sandbox.py $(BENCH_ARGS)

# A network namespace per sandbox (isolated) vs the host's network, side by side, and the
# egress proxy vs a direct download (docs/sandbox.md §Network); ~3 minutes.
bench-network: setup
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/network.py $(BENCH_ARGS)

# Per-request cost of the light routes (/health, /api/hermes/client/tools) against a bare
# Flask + waitress app of the same thread count, wrk -c8, alternating runs; ~1 min.
# BENCH_ARGS="--rounds 5 --log-format json" etc.
bench-requests: setup-service wrk
	HERMES_BIN="$(CURDIR)/$(HVENV)/bin/hermes" $(VENV)/bin/python bench/request_cost.py $(BENCH_ARGS)

# A tool call's added latency through mnote's kernel: http and command against the embedded
# store, alternating call by call (docs/benchmarks.md §Kernel adapter); ~2 min.
# BENCH_ARGS="--calls 500".
bench-kernel: setup-service
	$(VENV)/bin/python bench/kernel_adapter.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(HVENV) $(TVENV) tools/node_modules
