# Two commands on a fresh machine: `make bench` (creates .venv, builds the extension, installs what the
# benchmark needs) and `make test` (the same, plus what the tests need). The build has the CUDA backend
# always (on the driver API), the kernels' fatbin when nvcc is found; GPU_OFFLOAD_CUDA=0 for a CPU-only build.
PYTHON_SYS ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip --disable-pip-version-check -q
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.gpu_offload-installed
TEST_STAMP := $(VENV)/.gpu_offload-test-installed
SOURCES    := $(shell find csrc gpu_offload -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh') CMakeLists.txt setup.py pyproject.toml
PYTEST_ARGS ?=
# The Python suite runs on every core (pytest-xdist; its multi-rank tests pick free ports). PYTEST_WORKERS=0 runs
# it in this one process.
PYTEST_WORKERS ?= auto
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup build test test-cpp test-py bench bench-micro clean nocuda-check sanitize-check

# Everything: the package and what the tests need.
setup: $(STAMP) $(TEST_STAMP)

$(PY):
	$(PYTHON_SYS) -m venv $(VENV)

# What `make bench` needs, no more: torch first (the local CPU wheel where one exists), then the build tools,
# then the package in place with its own dependencies, built in build/cmake (named: setup.py otherwise builds
# in a scratch folder), where test-cpp runs ctest.
$(STAMP): $(SOURCES) | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)" "setuptools>=77" wheel "pybind11>=2.12" ninja "cmake>=3.24"
	GPU_OFFLOAD_TORCH_EXT=1 GPU_OFFLOAD_BUILD_DIR=build/cmake $(PIP) install --no-build-isolation -e .
	touch $(STAMP)

# What the tests add (pytest, DeepSpeed, megatron-core, Ray, transformers, matplotlib: about 1 GB): the same
# install with the extras, the build already done (ninja finds nothing to rebuild). After $(STAMP) only in
# order, so that a source change rebuilds without installing the extras again.
$(TEST_STAMP): pyproject.toml | $(STAMP)
	GPU_OFFLOAD_TORCH_EXT=1 GPU_OFFLOAD_BUILD_DIR=build/cmake $(PIP) install --no-build-isolation -e ".[test,all,deepspeed]"
	touch $(TEST_STAMP)

build: $(STAMP)

test-cpp: $(STAMP)
	ctest --test-dir build/cmake --output-on-failure

test-py: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test: test-cpp test-py

bench: $(STAMP)
	$(PY) -m gpu_offload bench

# The same sources built with GPU_OFFLOAD_CUDA=0 (no nvcc involved; _C only, the package copy keeps the tree's
# torch-aware helper): C++ tests, then the engine tests run against that module from a scratch copy of the package.
NOCUDA_DIR := build/nocuda
nocuda-check: setup
	GPU_OFFLOAD_CUDA=0 GPU_OFFLOAD_TORCH_EXT=0 GPU_OFFLOAD_BUILD_DIR=$(NOCUDA_DIR)/cmake $(PY) setup.py -q build_ext --build-lib $(NOCUDA_DIR)/lib
	ctest --test-dir $(NOCUDA_DIR)/cmake --output-on-failure
	rm -rf $(NOCUDA_DIR)/pkg && mkdir -p $(NOCUDA_DIR)/pkg && cp -r gpu_offload $(NOCUDA_DIR)/pkg/ \
	  && rm -f $(NOCUDA_DIR)/pkg/gpu_offload/_C*.so && cp $(NOCUDA_DIR)/lib/gpu_offload/_C*.so $(NOCUDA_DIR)/pkg/gpu_offload/
	cd tests && PYTHONPATH=$(CURDIR)/$(NOCUDA_DIR)/pkg GPU_OFFLOAD_EXPECT_CUDA_BUILD=0 $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider \
	  --rootdir=$(CURDIR) -c $(CURDIR)/pyproject.toml test_build.py test_roundtrip.py test_errors.py test_arena.py

# AddressSanitizer + UndefinedBehaviorSanitizer (not in CI: a developer's check, about 3 minutes): the C++ tests
# (the simulated driver's included), then both modules built with them and the engine's tests that reach the
# most C++ run against that build, with the sanitizers' runtime preloaded into Python (leaks not reported:
# the interpreter's and torch's own would drown ours).
ASAN_DIR := build/asan
SANITIZE := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
SANITIZER_RUNTIME = $(shell $(CXX) -print-file-name=libasan.so) $(shell $(CXX) -print-file-name=libubsan.so)
sanitize-check: setup
	cmake -S . -B $(ASAN_DIR)/cmake -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGPU_OFFLOAD_BUILD_TESTS=ON \
	  -DPython_EXECUTABLE=$(CURDIR)/$(PY) -Dpybind11_DIR=$$($(PY) -c 'import pybind11; print(pybind11.get_cmake_dir())') \
	  "-DCMAKE_CXX_FLAGS=$(SANITIZE)" "-DCMAKE_EXE_LINKER_FLAGS=$(SANITIZE)"
	cmake --build $(ASAN_DIR)/cmake --target test_arena test_copy_plan test_checksum test_ledger test_sim
	ASAN_OPTIONS=detect_leaks=0 ctest --test-dir $(ASAN_DIR)/cmake --output-on-failure
	CFLAGS="$(SANITIZE)" LDFLAGS="$(SANITIZE)" GPU_OFFLOAD_TORCH_EXT=1 GPU_OFFLOAD_BUILD_DIR=$(ASAN_DIR)/py \
	  GPU_OFFLOAD_CUDA_ARCHS=90-real $(PY) setup.py -q build_ext --build-lib $(ASAN_DIR)/lib
	rm -rf $(ASAN_DIR)/pkg && mkdir -p $(ASAN_DIR)/pkg && cp -r gpu_offload $(ASAN_DIR)/pkg/ \
	  && rm -f $(ASAN_DIR)/pkg/gpu_offload/*.so && cp $(ASAN_DIR)/lib/gpu_offload/*.so $(ASAN_DIR)/pkg/gpu_offload/
	cd tests && LD_PRELOAD="$(SANITIZER_RUNTIME)" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  PYTHONPATH=$(CURDIR)/$(ASAN_DIR)/pkg $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider \
	  -n $(PYTEST_WORKERS) --rootdir=$(CURDIR) -c $(CURDIR)/pyproject.toml test_torch_ext.py test_host_cost.py \
	  test_offloaded_access.py test_plan_cache.py test_lifetime.py test_faults.py test_roundtrip.py test_strategies.py \
	  test_fuzz.py test_swap_overlap.py test_errors.py test_persist.py test_arena.py test_sim_driver.py test_integrity.py \
	  test_cpu_reload_blocks.py test_fsdp.py test_reload_parts.py

bench-micro: setup
	$(PY) -m pytest benchmarks --benchmark-only -p no:cacheprovider --benchmark-columns=min,median,mean,rounds

clean:
	rm -rf build *.egg-info gpu_offload/_C*.so gpu_offload/_torch_ext*.so
