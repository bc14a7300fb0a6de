# deltackpt: `make demo` and `make test` work on a fresh machine (they create .venv first).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.deltackpt-installed
DEMO_STORE ?= demo-store
BENCH_OUT ?= bench-out

.PHONY: install test test-all demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard native/*.c native/*.h)
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet "setuptools>=64" wheel
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet --no-build-isolation -e '.[dev,bench]'
	$(PYTHON) -c "import deltackpt.kernels as k; print('deltackpt kernels:', k.BACKEND)"
	touch $(STAMP)

# The fast default: everything but the multi-process (distributed) suites and the slow stress tests.
test: install
	$(PYTHON) -m pytest -q -m "not slow and not distributed"

# Everything, as CI runs it.
test-all: install
	$(PYTHON) -m pytest -q

# The main job: a small transformer trained with FSDP2 on 2 CPU ranks, checkpointed every 10 steps.
demo: install
	rm -rf $(DEMO_STORE)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py \
		--store $(DEMO_STORE) --steps 40 --save-every 10
	$(VENV)/bin/deltackpt ls $(DEMO_STORE)
	$(VENV)/bin/deltackpt du $(DEMO_STORE)

bench: install
	$(PYTHON) -m pip install --quiet --no-build-isolation -e '.[peers]'
	mkdir -p $(BENCH_OUT)
	$(PYTHON) benchmarks/bench_kernels.py --json $(BENCH_OUT)/kernels.json
	$(PYTHON) benchmarks/bench_dcp.py --json $(BENCH_OUT)/dcp.json
	$(VENV)/bin/deltackpt bench --out $(BENCH_OUT)/workloads

clean:
	rm -rf build *.egg-info deltackpt/_native*.so $(DEMO_STORE) $(BENCH_OUT)
