# make check: set up .venv (first use) and run the main job on the tiny default.
# make test:  set up .venv (first use) and run the test suite's quick tier; make test-deep: its deep tier.
PYTHON ?= python3
# a CUDA machine passes e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_INDEX ?=
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: check test test-deep setup clean

# no .pyc at set-up (pip --no-compile): each module's is written by the first process that imports it, a
# quarter of the venv's 20,800 files (measured: the suite reads 5,233); compiling them all at set-up took
# 29-40 s of a fresh clone's `make test` on 2 cores. So Python writes them here even where the
# environment says not to (PYTHONDONTWRITEBYTECODE): else every test process compiles its imports again
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: pip takes the CPU build on disk; unpinned it pulls a CUDA build
	$(PY) -m pip install -q --no-compile torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	# every backend that runs on Linux: iree, mlx (CPU), executorch, llama.cpp (pinned in pyproject.toml;
	# llama-cpp-python is built from source the first time: 5 min on 2 cores, docs/llamacpp.md, then pip's cache)
	$(PY) -m pip install -q --no-compile -e ".[all]"
	# llama.cpp's converter (convert_hf_to_gguf.py), from the same version's source distribution
	$(PY) -m exporters.llamacpp setup
	touch $(STAMP)

setup: $(STAMP)

check: $(STAMP)
	$(VENV)/bin/oracle check --family olmoe --backend eager --json reports/check-olmoe-eager.json \
		--markdown reports/check-olmoe-eager.md

# the suite in parallel workers (pytest-xdist), one test file per worker at a time: a file's
# shared exports stay in one process, and two files needing one artifact share it through the
# cache (oracle/cache/artifacts.py: one build per entry across processes). Measured on 2 cores:
# 10.0 min of pytest by file, 13.3 min with work stealing (fixtures built twice). TEST_JOBS=0: serial.
# The files in collection order, the longest first (tests/conftest.py LONGEST_FIRST), not xdist's by count.
# `make test` is the quick tier (within 15 minutes cold on 2 cores); `make test-deep` the deep tier (tests/depth.py
# DEEP: second proofs of paths the quick tier proves, long scenarios), run nightly (.github/workflows/oracle-nightly.yml)
TEST_JOBS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PYTEST) -m "not deep"

test-deep: $(STAMP)
	$(PYTEST) -m deep

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
