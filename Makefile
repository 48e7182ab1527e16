# sapipe developer tasks. Every target sets up what it needs by itself.
#
#   make venv     create $(VENV) and install torch==2.13.0 (CPU), numpy, pytest, the
#                 frameworks sapipe integrates with (requirements-integrations.txt, under
#                 constraints.txt: torch stays pinned) and sapipe (editable). Idempotent: a
#                 stamp file makes re-runs instant.
#   make lint     venv + ruff (lint and format check) and mypy over the public API
#   make test     venv + lint + pytest over tests/
#   make demo     venv + examples/demo.py, 2 ranks (Gloo) on a loopback limited to DEMO_NET (200mbit)
#   make bench    venv + benchmarks/throughput.py: the default throughput sweep under an
#                 emulated network (needs root or user namespaces; installs iproute2 if tc
#                 is missing). Options: BENCH_ARGS="--quick"
#   make peers    opt-in: build Horovod $(HOROVOD_VERSION) (CPU, Gloo) into the venv as a baseline
#   make gpu-check  on a GPU machine with a CUDA torch (no venv): build in place, CUDA tests,
#                 kernel bandwidth and compensation overhead (benchmarks/gpu_check.sh)
#   make clean    remove build artefacts and caches (keeps the venv)
#   make distclean  clean + remove the venv

PYTHON ?= python3
VENV   ?= .venv
NPROC  ?= 2
PYTEST_ARGS ?=
DEMO_ARGS ?=
DEMO_NET ?= 200mbit
BENCH_ARGS ?=
HOROVOD_VERSION ?= 0.28.1

VPY   := $(VENV)/bin/python
VPIP  := $(VPY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.sapipe-installed

# Re-install when packaging changes, when the package first appears
# (sapipe/__init__.py decides what the editable finder maps), or when csrc/ changes
# (once the extension is built by setup.py).
STAMP_DEPS := setup.py pyproject.toml requirements-dev.txt requirements-integrations.txt constraints.txt MANIFEST.in $(wildcard build_backend/*.py) \
              $(wildcard sapipe/__init__.py) $(wildcard csrc/* csrc/*/*)

.PHONY: venv lint test demo clean distclean bench peers convergence gpu-check

venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# torch is installed FIRST, pinned by constraints.txt, which every later install honours, so
# pip never resolves `torch` itself (that would download CUDA wheels); setup.py's `torch>=2.1`
# is then satisfied.
$(STAMP): $(VPY) $(STAMP_DEPS)
	$(VPIP) install -q -c constraints.txt torch
	$(VPIP) install -q -c constraints.txt -r requirements-dev.txt
	$(VPIP) install -q -c constraints.txt -r requirements-integrations.txt
	$(VPIP) install -q --no-build-isolation -e .
	$(VPY) -c "import torch; print('torch', torch.__version__)"
	@touch $@

# ruff's configuration and mypy's list of public modules are in pyproject.toml
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q $(PYTEST_ARGS) tests

# The demo's link is a loopback limited to DEMO_NET (sapipe-launch --emulate-net), so that
# communication costs about what compute does, as on a cluster; without network namespaces
# it says so and runs on the plain loopback, where there is little for sapipe to hide.
demo: venv
	@if $(VPY) -c "import sys; from sapipe.launch import netns; ok, why = netns.check(netns.parse_spec('$(DEMO_NET)')); print(why); sys.exit(0 if ok else 1)" >/tmp/sapipe-demo-net.txt 2>&1; then \
	  echo "make demo: $(NPROC) ranks on a loopback limited to $(DEMO_NET) (sapipe-launch --emulate-net $(DEMO_NET)); DEMO_NET=... changes it"; \
	  OMP_NUM_THREADS=1 $(VENV)/bin/sapipe-launch --quiet --emulate-net $(DEMO_NET) --nproc-per-node=$(NPROC) examples/demo.py $(DEMO_ARGS); \
	else \
	  echo "make demo: cannot emulate a slow link here ($$(cat /tmp/sapipe-demo-net.txt)); running on the plain loopback, where communication is nearly free and sapipe has little to hide"; \
	  OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/demo.py $(DEMO_ARGS); \
	fi

# Throughput sweep (docs/design.md §6; benchmarks/throughput_bench/). tc/ip come from iproute2; install it when missing.
bench: venv
	@command -v tc >/dev/null && command -v unshare >/dev/null || \
	  { echo "installing iproute2 (tc) and util-linux (unshare)"; \
	    apt-get update -qq && apt-get install -y -qq iproute2 util-linux; }
	@$(VPY) -c "import matplotlib" 2>/dev/null || $(VPIP) install -q -c constraints.txt -r benchmarks/requirements.txt
	$(VPY) benchmarks/throughput.py $(BENCH_ARGS)

# Convergence benchmark: 3 tasks x (sync, pipesgd, dc, wp1-3) x 3 seeds, 4 ranks (Gloo),
# plus a dc/wp3 lambda sweep and each task's best mode with bf16, int8 and int8 without error
# feedback; writes benchmarks/results/convergence.md and PNGs (~20-35 min on 2 cores).
# Options: CONVERGENCE_ARGS="--quick" (smoke run, < 2 min), "--k auto", "--study compression"
# (the compression study alone, ~8 min; writes results/convergence_compression.md).
convergence: venv
	$(VPIP) install -q -c constraints.txt -r benchmarks/requirements.txt
	OMP_NUM_THREADS=1 $(VPY) benchmarks/convergence.py $(CONVERGENCE_ARGS)

# Horovod from the PyPI sdist, CPU-only with Gloo. Its CMake pins C++14 but torch 2.x
# headers need C++17 (and its CMakeLists strips -std= from CXXFLAGS), so the sdist is
# unpacked in a temp dir and its CMAKE_CXX_STANDARD raised to 17 before building.
peers: venv
	@if $(VPY) -c "import horovod.torch" 2>/dev/null; then echo "horovod already installed"; else \
	  set -e; tmp=$$(mktemp -d); trap "rm -rf $$tmp" EXIT; \
	  $(VPIP) install -q cloudpickle psutil pyyaml packaging; \
	  $(VPIP) download -q --no-deps --no-binary :all: "horovod==$(HOROVOD_VERSION)" -d $$tmp; \
	  tar -xzf $$tmp/horovod-$(HOROVOD_VERSION).tar.gz -C $$tmp; \
	  src=$$tmp/horovod-$(HOROVOD_VERSION); \
	  sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' $$src/CMakeLists.txt $$src/horovod/torch/CMakeLists.txt; \
	  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
	  HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=-j$$(nproc) \
	    $(VPIP) install --no-build-isolation --no-deps $$src; \
	  $(VPY) -c "import horovod, horovod.torch as hvd; print('horovod', horovod.__version__, 'gloo built:', hvd.gloo_built())"; \
	fi

gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache
	rm -f $(STAMP)  # the kernels built in place go below: the next target reinstalls (and rebuilds) them
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o \( -name '*.so' -o -name '*.pyc' \) -type f -exec rm -f {} +

distclean: clean
	rm -rf $(VENV)
