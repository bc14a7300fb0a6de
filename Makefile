# deltackpt: `make demo` and `make test` work on a fresh machine (they create .venv first).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.deltackpt-installed
DEMO_STORE ?= demo-store
BENCH_OUT ?= bench-out

.PHONY: install test test-all demo bench asan clean

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

# The C kernels under AddressSanitizer and UBSan: a copy of the tree in build/asan (the .venv's build is left
# alone), its extension built with the sanitizers, and the tests that drive the kernels and the parsers
# (PYTHONMALLOC=malloc: small Python buffers from malloc, which ASan watches, not from pymalloc's arenas;
# allocator_may_return_null: a too-large allocation is a MemoryError, as without ASan, not an abort).
ASAN_TESTS ?= tests/test_kernels.py tests/store/test_hostile_metadata.py tests/store/test_manifest_refs.py \
	tests/store/test_fuzz_parsers.py tests/store/test_planebatch.py tests/store/test_delta.py \
	tests/store/test_codec_zdelta.py tests/store/test_verify.py tests/store/test_read_path.py \
	tests/store/test_corruption.py
asan: install
	rm -rf build/asan && mkdir -p build/asan
	git ls-files -z | xargs -0 tar cf - | tar xf - -C build/asan
	cd build/asan && DELTACKPT_NATIVE_SANITIZE=1 $(CURDIR)/$(PYTHON) setup.py -q build_ext --inplace
	cd build/asan && LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
		UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONMALLOC=malloc PYTHONPATH=. DELTACKPT_REQUIRE_NATIVE=1 \
		$(CURDIR)/$(PYTHON) -m pytest -q -p no:cacheprovider $(ASAN_TESTS)

clean:
	rm -rf build *.egg-info deltackpt/_native*.so $(DEMO_STORE) $(BENCH_OUT)
