# amp_graph: two commands on a fresh machine.
#   make demo   creates .venv, installs amp_graph and runs the demo (about 2 minutes, install
#               included; make demo-full is the long run)
#   make test   same venv, runs the test suite
#   make test-torch-latest   the suite on the newest torch pyproject admits (a venv of its own)
#   make docs   the documentation site into site/ (mkdocs-material, offline; a venv of its own)
# and on a machine with an NVIDIA GPU:
#   make gpu-check   every CUDA test and the GPU benchmarks (< 10 minutes); writes the figures
#                    into BENCHMARKS.md's GPU table. Fails at once, saying so, without a GPU.
#                    Installs this checkout into the machine's Python first if it lacks it.
#   make gpu-rehearsal  (here, before a GPU session) gpu-check's scripts on the CPU under the
#                    GPU machine's torch 2.11 and torchao 0.17: what would fail there
#   make gpu-wheels  (here, with a network) the wheels gpu-check installs from .whl/ on a GPU
#                    machine that has no network: torchao, the fp8 step's reference
#   make gpu-check GPU_CHECK_ARGS="--only mfu fp8_step"   some stages alone (the others keep
#                    an earlier run's figures); .whl/ is git-ignored: carry it to the GPU machine
#
# torch: if the Python that creates the venv already has torch (say a CUDA build), the venv
# sees it (--system-site-packages) and nothing is downloaded; otherwise TORCH_SPEC is
# installed (the CPU build on these machines). Override, e.g.:
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

VENV_READY := $(VENV)/.torch
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo demo-full test test-hf-fx test-torch-latest lint bench install clean gpu-check gpu-rehearsal docs \
	gpu-wheels

# The venv with torch in it (see the top of this file).
$(VENV_READY):
	@if [ ! -x $(BIN)/python ]; then \
		if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
			echo "using the torch of $(PYTHON)"; $(PYTHON) -m venv --system-site-packages $(VENV); \
		else $(PYTHON) -m venv $(VENV); fi; fi
	@$(BIN)/python -c "import torch" >/dev/null 2>&1 || $(BIN)/pip install -q $(TORCH_SPEC)
	@touch $(VENV_READY)

# Everything: tests, linters, notebooks, the reference libraries.
$(STAMP): pyproject.toml $(VENV_READY)
	$(BIN)/pip install -q -e ".[dev]"
	@touch $(STAMP) $(DEMO_STAMP)

# Only what the demo needs (amp_graph and scikit-learn's digits): quick on a fresh clone.
$(DEMO_STAMP): pyproject.toml $(VENV_READY)
	$(BIN)/pip install -q -e ".[demo]"
	@touch $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m amp_graph demo

demo-full: $(DEMO_STAMP)
	$(BIN)/python -m amp_graph demo --full

# --durations=20: the slowest tests, so that every CI log names them for its CPU kind.
# -n: pytest-xdist workers (tests/conftest.py gives each process one torch thread, so one
# worker per core); --dist loadfile keeps each file's tests in one process, in their order.
PYTEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=20
test: $(STAMP)
	$(BIN)/python $(PYTEST)

# HF's own fx tracer (transformers.utils.fx), which transformers 5 removed: a venv inside .venv
# that sees .venv's packages with transformers 4.46.3 over them, for tests/test_hf_fx_tracer.py
# (the one file that needs it; under .venv's transformers it skips, saying so).
HF_FX_VENV := $(VENV)/hf-fx
HF_FX_PINS := transformers==4.46.3 "tokenizers>=0.20,<0.21" "huggingface_hub>=0.23.2,<1.0" \
	requests urllib3 idna certifi charset_normalizer

test-hf-fx: $(STAMP)
	@if [ ! -x $(HF_FX_VENV)/bin/python ]; then \
		$(BIN)/python -m venv $(HF_FX_VENV) && \
		main=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		side=$$($(HF_FX_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		echo "import site; site.addsitedir('$$main')" > $$side/main_venv.pth && \
		$(HF_FX_VENV)/bin/pip install -q --no-deps $(HF_FX_PINS); fi
	$(HF_FX_VENV)/bin/python -m pytest -q tests/test_hf_fx_tracer.py

# The newest torch release pyproject's range admits (the registry's CUDA wheel; it runs on
# the CPU), in a venv of its own with amp_graph and the dev tools: the whole suite, as a user
# who just ran `pip install amp_graph` gets it. These machines cap pip at torch 2.14.1
# (/etc/xdg/pip); the cap is lifted for this venv's install only. CI runs it.
LATEST_VENV := $(VENV)/torch-latest
TORCH_RANGE := $(shell sed -n 's/.*"\(torch[<>=!~][^"]*\)".*/\1/p' pyproject.toml | head -1)

$(LATEST_VENV)/.installed: pyproject.toml
	@[ -x $(LATEST_VENV)/bin/python ] || $(PYTHON) -m venv $(LATEST_VENV)
	PIP_CONSTRAINT=/dev/null $(LATEST_VENV)/bin/pip install -q "$(TORCH_RANGE)" -e ".[dev]"
	@touch $@

test-torch-latest: $(LATEST_VENV)/.installed
	@$(LATEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__, '(newest in $(TORCH_RANGE))')"
	@PIP_CONSTRAINT=/dev/null $(LATEST_VENV)/bin/pip index versions torch 2>/dev/null | head -1 || true
	$(LATEST_VENV)/bin/python $(PYTEST)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The docs tools in a venv of their own (no torch: mkdocstrings reads the source, imports
# nothing), from pyproject's `docs` extra; --strict fails on a broken link or a bad docstring.
DOCS_VENV := $(VENV)/docs
$(DOCS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q $$($(PYTHON) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))")
	@touch $@

docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/compile_bench.py

# The venv's Python when there is one, else $(PYTHON) (a GPU machine's own torch, with amp_graph
# installed into it: `pip install --no-deps --no-build-isolation -e .` works offline).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

# torchao for the GPU machine's Python (3.12, torch 2.11): its float8 training is the fp8 step's
# reference (benchmarks/fp8_step.py); pure Python where that step uses it.
GPU_WHEELS := torchao==0.17.0

gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

# A fresh GPU machine's Python lacks amp_graph: the checkout goes into it first (offline, as an
# editable install, so its tests and benchmarks import this tree), unless this tree's
# amp_graph.passes already imports there. The wheels in .whl/ (make gpu-wheels), if any, go into
# .whl/site for this run alone.
GPU_HAS_CHECKOUT := import amp_graph.passes as p, pathlib, sys; \
	sys.exit(pathlib.Path(p.__file__).resolve().parent != pathlib.Path('passes').resolve())
gpu-check:
	$(GPU_PYTHON) -c "$(GPU_HAS_CHECKOUT)" 2>/dev/null || \
		$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	$(if $(wildcard .whl/*.whl),$(GPU_PYTHON) -m pip install -q --no-index --no-deps \
		--no-compile --upgrade --target .whl/site .whl/*.whl && \
		export PYTHONPATH=$(CURDIR)/.whl/site:$$PYTHONPATH &&) \
		$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# gpu-check's scripts on the CPU under the GPU machine's torch and torchao (a venv of its own,
# about 5 GB: torch's CUDA build, run on the CPU), before a GPU session spends its minutes on
# them (benchmarks/gpu_rehearsal.py; about 9 minutes here).
GPU_REHEARSAL_VENV := $(VENV)/torch-gpu
GPU_MACHINE_TORCH := torch==2.11.0

$(GPU_REHEARSAL_VENV)/.installed: pyproject.toml
	@[ -x $(GPU_REHEARSAL_VENV)/bin/python ] || $(PYTHON) -m venv $(GPU_REHEARSAL_VENV)
	$(GPU_REHEARSAL_VENV)/bin/pip install -q $(GPU_MACHINE_TORCH) $(GPU_WHEELS) networkx numpy \
		pytest pytest-xdist pytest-timeout ninja wheel "setuptools>=64"
	$(GPU_REHEARSAL_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	@touch $@

gpu-rehearsal: $(GPU_REHEARSAL_VENV)/.installed
	$(GPU_REHEARSAL_VENV)/bin/python benchmarks/gpu_rehearsal.py $(GPU_REHEARSAL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info site
