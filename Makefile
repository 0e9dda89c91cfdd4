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

.PHONY: setup build test test-cpp test-py bench bench-micro clean nocuda-check

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

bench-micro: setup
	$(PY) -m pytest benchmarks --benchmark-only -p no:cacheprovider --benchmark-columns=min,median,mean,rounds

clean:
	rm -rf build *.egg-info gpu_offload/_C*.so gpu_offload/_torch_ext*.so
