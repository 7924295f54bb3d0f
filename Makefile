# The two commands a newcomer needs (README.md): `make quickstart` and `make test`.
# Both create .venv and install mpzero into it first; `make test` adds the test tools and Triton (the fused
# kernels' tests run under Triton's CPU interpreter). TORCH names the torch build to install: the default is
# the CPU wheel this project is tested with; on a GPU cluster keep your own CUDA build (`make test TORCH=torch`).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: quickstart test install gpu-check docs

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test,triton]"
	touch $@

install: $(VENV)/.installed

quickstart: install
	bash examples/quickstart.sh $(PY)

test: $(VENV)/.test-installed
	$(PY) -m pytest -q tests

# The CUDA checks and GPU benchmarks in one run (docs/gpu.md): the machine's own python3 and torch,
# nothing installed; report.md and raw logs in OUT. Without CUDA: one line, a validated all-skipped report, exit 0.
OUT ?= gpu-report
gpu-check:
	PYTHONPATH=. $(PYTHON) -m tests.gpu.check --out $(OUT)

# The parts of README.md, docs/ and bench/README.md the code determines (sample outputs, flag defaults, the
# Megatron-LM table), made again; tests/test_docs.py fails while one is stale.
docs: $(VENV)/.test-installed
	$(PY) -m tests.docs.update
