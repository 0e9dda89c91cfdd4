# Two commands on a fresh machine: `make test` and `make bench`. Both create .venv and build the extension
# (CUDA code compiled when nvcc is found; GPU_OFFLOAD_CUDA=0 for a CPU-only build).
PYTHON_SYS ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip --disable-pip-version-check -q
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.gpu_offload-installed
SOURCES    := $(shell find csrc gpu_offload -name '*.cpp' -o -name '*.hpp' -o -name '*.cu') CMakeLists.txt setup.py pyproject.toml
PYTEST_ARGS ?=
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup build test test-cpp test-py bench clean

setup: $(STAMP)

$(PY):
	$(PYTHON_SYS) -m venv $(VENV)

# torch first (the local CPU wheel where one exists), then the build tools, then the package in place.
$(STAMP): $(SOURCES) | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)" setuptools wheel "pybind11>=2.12" ninja cmake
	$(PIP) install --no-build-isolation -e ".[test,all]"
	touch $(STAMP)

build: setup

test-cpp: setup
	ctest --test-dir build/cmake --output-on-failure

test-py: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test: test-cpp test-py

bench: setup
	$(PY) -m gpu_offload bench

clean:
	rm -rf build *.egg-info gpu_offload/_C*.so
