# The two commands a newcomer needs (README.md): `make quickstart` and `make test`.
# Both create .venv and install mpzero into it first; `make test` adds the test tools and Triton (without a GPU
# the fused kernels' tests run under Triton's CPU interpreter). TORCH names the torch build to install: the default
# is the CPU wheel this project is tested with; on a GPU cluster keep your own CUDA build (`make test TORCH=torch`).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: quickstart test install gpu-check gpu-wheels docs

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

# A CUDA build of torch brings the Triton it was built with; only a CPU build gets the pinned one.
$(VENV)/.test-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q -e ".[triton]"
	touch $@

install: $(VENV)/.installed

quickstart: install
	bash examples/quickstart.sh $(PY)

test: $(VENV)/.test-installed
	$(PY) -m pytest -q tests

# The CUDA checks and GPU benchmarks in one run (docs/gpu.md): the machine's own python3 and torch,
# nothing installed but the wheels in WHEELS, if any; report.md and raw logs in OUT. Without CUDA: one line, a
# validated all-skipped report, exit 0.
OUT ?= gpu-report
WHEELS ?= .whl
gpu-check:
	PYTHONPATH=. $(PYTHON) -m tests.gpu.check --out $(OUT) $(if $(wildcard $(WHEELS)/*.whl),--wheels $(WHEELS))

# torchao's wheel for a GPU machine with no network whose python lacks it (bench_fp8 needs it), downloaded here into
# WHEELS for that machine's Python (GPU_PYTHON) and x86-64 Linux. 0.18.0: the release paired with torch 2.11.
GPU_PYTHON ?= 3.12
TORCHAO ?= torchao==0.18.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(WHEELS) "$(TORCHAO)"

# The parts of README.md, docs/ and bench/README.md the code determines (sample outputs, flag defaults, the
# Megatron-LM table), made again; tests/test_docs.py fails while one is stale.
docs: $(VENV)/.test-installed
	$(PY) -m tests.docs.update
