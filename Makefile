# specd — `make up` starts the local cluster, `make test` runs every check.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
PIP_INSTALL := $(PIP) install -q --disable-pip-version-check
# uv, from PyPI into the virtualenv where it is not there yet (`make setup`, `make lock`)
VENV_UV := .venv/bin/uv
UV_INTO_VENV := test -x $(VENV_UV) || $(PIP_INSTALL) uv
TORCH   := .venv/.torch-done
STAMP   := .venv/.setup-done
TMPDIR  ?= /tmp
# torch is pinned and installed first: the CPU wheel on a machine without a GPU, so pip
# never pulls the multi-GB CUDA set there. TORCH_PIP_ARGS lets a user add an index.
TORCH_SPEC     ?= torch==2.13.0
TORCH_PIP_ARGS ?=

.PHONY: setup up test test-services test-in-process test-cuda lint format protos models test-models kernels deploy-tools bench peer-llamacpp lock clean

setup: $(STAMP)

# torch first, with ninja and numpy: all that the kernels' build needs, so that under
# `make -j` it compiles them while pip installs the rest
$(PY):
	python3 -m venv .venv

$(TORCH): | $(PY)
	$(PIP_INSTALL) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP_INSTALL) ninja numpy
	touch $(TORCH)

# the rest with uv (from PyPI, into the virtualenv): it resolves and unpacks in a tenth of
# pip's CPU time, the largest share of a fresh machine's setup. uv reads no pip
# configuration: where it cannot install (an index only pip is configured for), pip does
$(STAMP): pyproject.toml $(TORCH)
	{ $(UV_INTO_VENV) && $(VENV_UV) pip install -q --python $(PY) --compile-bytecode -e ".[dev]"; } \
	  || $(PIP_INSTALL) -e ".[dev]"
	touch $(STAMP)

# the real models, fetched and converted, with the int4 weights (the default format) they
# serve from written now rather than at a first start; a target a model, so that under
# `make -j` they convert side by side (each conversion runs on one core). Their GGUF files
# need only pip and the standard library: under `make -j` they download while torch installs
models: model-small model-default-target model-default-draft
model-%: setup gguf-%
	.venv/bin/specd models fetch $* --weights int4
gguf-%: | $(PY)
	$(PY) -m specd.models.fetch $*

# the pair's int8 weights too, which the tests run beside int4
test-models: int8-default-target int8-default-draft
int8-%: model-%
	.venv/bin/specd models fetch $* --weights int8

up: setup
	.venv/bin/specd up

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

# kubectl (for `kubectl kustomize`; part of this machine image) and Debian's docker-compose
# (for `config`) validate deploy/ offline; neither needs a cluster or a Docker engine.
deploy-tools:
	@command -v kubectl >/dev/null || { echo "kubectl is required (kubectl kustomize)"; exit 1; }
	@command -v docker-compose >/dev/null || { \
	  apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; }
	@echo "deploy/: kustomize is the one source, both layouts rendered and validated by"
	@echo "  tests/deploy; no Helm chart (helm does not install from the package registries)"

# the native kernels: every instruction set's build compiled (about a minute, once per
# source), so a change that breaks the build this CPU does not run fails here too, and
# this CPU's loaded; fails when a CPU that runs one of them cannot build it. Built before
# the tests so that the first service a test starts does not spend its readiness
# deadline compiling them. Only torch is needed (specd is imported from this folder), and
# the compilers run at a lower priority, so that beside pip and the models' conversions
# they take the cores those leave
kernels: $(TORCH)
	nice -n 10 $(PY) -m specd.models.native

# the tests that run the native kernels, run again on each other build this CPU executes
# (an AVX512 host runs the AVX2 build too, with an AVX2 host's defaults: SPECD_ISA)
KERNEL_TESTS := tests/unit/test_qlinear.py tests/unit/test_paged_attention.py \
  tests/unit/test_layer_ops.py tests/unit/test_decoder_stack.py tests/unit/test_weights.py \
  tests/unit/test_mixed_steps.py tests/unit/test_native.py tests/unit/test_prefix_cache.py \
  tests/unit/test_huge_pages.py tests/unit/test_matmul.py tests/real/test_real_formats.py

# the tests and what they need, side by side (a fresh machine converts the models while it
# compiles the kernels), then the kernel tests again on each other build
test:
	$(MAKE) --no-print-directory -j4 --output-sync=target lint test-services test-in-process
	for isa in $$($(PY) -m specd.models.native --runnable | cut -s -d' ' -f2-); do \
	  echo "== the kernel tests on the $$isa build"; \
	  SPECD_ISA=$$isa $(PY) -m pytest -q -ra $(KERNEL_TESTS) || exit 1; \
	done

# the tests that start services: one at a time, at the usual CPU priority, as their
# deadlines assume
test-services: models kernels deploy-tools
	$(PY) -m pytest -q -ra --durations=20 tests/integration tests/deploy tests/cuda

# the in-process tests, the real models' (tests/real: the longest, handed out first) and the
# unit tests: a pytest-xdist worker a core (one torch thread each; at most 8, as each imports
# torch) at the lowest CPU priority, so that beside test-services they take only the cycles
# the services leave: SCHED_IDLE, which a waking process preempts at once (nice 19 where
# chrt cannot set it). A worker that runs out takes tests still queued on another
# (worksteal), so no core waits while one worker ends its share of the real models' tests
IDLE := $(shell chrt --idle 0 true 2>/dev/null && echo chrt --idle 0 || echo nice -n 19)
test-in-process: test-models kernels
	$(IDLE) $(PY) -m pytest -q -ra --durations=10 -n auto --maxprocesses 8 --dist worksteal \
	  tests/real tests/unit

# on a GPU machine: the CUDA tests, then the engine and forward tests on the GPU (skipped,
# not failed, by `make test` where torch sees no GPU)
test-cuda: setup
	SPECD_REQUIRE_CUDA=1 $(PY) -m pytest -q -ra tests/cuda tests/unit/test_gpu_kernels.py \
	  tests/unit/test_gpu_step.py
	SPECD_TEST_DEVICE=cuda $(PY) -m pytest -q -ra tests/unit/test_forward_parity.py \
	  tests/unit/test_engine.py tests/unit/test_engine_exactness.py tests/unit/test_plan_ahead.py \
	  tests/unit/test_logprobs.py tests/unit/test_prompt_logprobs.py

protos: setup
	$(PY) -m protos.generate

# deploy/requirements.lock: every package the image installs beside torch, pinned (torch
# comes from TORCH_SPEC on its own index), for Python 3.11 on x86-64 Linux, resolved
# against the CPU torch wheel. Regenerate after changing pyproject.toml's dependencies;
# needs uv (`make setup` puts it in .venv) and the PyTorch CPU index (or
# LOCK_TORCH="--find-links DIR" with the wheel in DIR).
UV         ?= $(VENV_UV)
LOCK_TORCH ?= --extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match
lock: setup
	$(UV_INTO_VENV)
	echo "$(TORCH_SPEC)+cpu" > $(TMPDIR)/specd-torch-cpu.txt
	$(UV) pip compile pyproject.toml --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 $(LOCK_TORCH) \
	  -c $(TMPDIR)/specd-torch-cpu.txt --no-emit-package torch \
	  --custom-compile-command "make lock" -o deploy/requirements.lock

bench: setup
	.venv/bin/specd bench engine

# llama.cpp's llama-server and llama-bench, built from the llama-cpp-python sdist, for
# `specd bench sweep --peer llamacpp` (never part of `make test`)
peer-llamacpp: setup
	PYTHON=$(abspath $(PY)) bash bench/peer/build_llamacpp.sh

clean:
	rm -rf .venv build *.egg-info
