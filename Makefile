# sapipe developer tasks. Every target sets up what it needs by itself.
#
#   make venv     create $(VENV) and install torch==2.13.0 (CPU), numpy, pytest and
#                 sapipe (editable). Idempotent: a stamp file makes re-runs instant.
#   make test     venv + pytest over tests/
#   make demo     venv + examples/demo.py under torchrun, 2 ranks, Gloo
#   make clean    remove build artefacts and caches (keeps the venv)
#   make distclean  clean + remove the venv

PYTHON ?= python3
VENV   ?= .venv
TORCH_VERSION ?= 2.13.0
NPROC  ?= 2
PYTEST_ARGS ?=
DEMO_ARGS ?=

VPY   := $(VENV)/bin/python
VPIP  := $(VPY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.sapipe-installed

# Re-install when packaging changes, when the package first appears
# (sapipe/__init__.py decides what the editable finder maps), or when csrc/ changes
# (once the extension is built by setup.py).
STAMP_DEPS := setup.py pyproject.toml requirements-dev.txt \
              $(wildcard sapipe/__init__.py) $(wildcard csrc/*)

.PHONY: venv test demo clean distclean

venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# torch is installed FIRST and pinned, so pip never resolves `torch` itself
# (that would download CUDA wheels); setup.py's `torch>=2.1` is then satisfied.
$(STAMP): $(VPY) $(STAMP_DEPS)
	$(VPIP) install -q "torch==$(TORCH_VERSION)"
	$(VPIP) install -q -r requirements-dev.txt
	$(VPIP) install -q --no-build-isolation -e .
	$(VPY) -c "import torch; print('torch', torch.__version__)"
	@touch $@

test: venv
	$(VENV)/bin/pytest -q $(PYTEST_ARGS) tests

demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/demo.py $(DEMO_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o \( -name '*.so' -o -name '*.pyc' \) -type f -exec rm -f {} +

distclean: clean
	rm -rf $(VENV)
