# tiergate: the two commands are `make run` and `make test`; both build .venv from the pins.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tiergate-installed
export LITELLM_LOCAL_MODEL_COST_MAP := True
export TOKENIZERS_PARALLELISM := false

.PHONY: deploy-smoke run test test-fast test-fast-libraries test-fast-gateway-http test-fast-gateway-rest venv lint typecheck imports unit clean bench-venv bench-llama-cpp

venv: $(STAMP)

$(STAMP): requirements/constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -c requirements/constraints.txt "torch==2.13.0"
	$(PIP) install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[dev]"
	$(PY) -m gateway.cli.pins --check
	$(PY) -m engine.native.build || echo "engine: native kernels not built here; the engine runs its plain-torch kernels"
	touch $(STAMP)

run: venv
	$(VENV)/bin/tiergate db upgrade
	$(VENV)/bin/tiergate serve --demo

lint: venv
	$(VENV)/bin/ruff check .

typecheck: venv
	$(VENV)/bin/mypy

imports: venv
	$(VENV)/bin/lint-imports

unit: venv
	$(VENV)/bin/pytest -q -ra

test: venv lint typecheck imports unit

# The unit lane (~80 s of CPU: about a minute on two free cores): no service, subprocess, browser or
# slow test. The marks are kept true by tests/lanes.py (a test that spawns a process or reaches a
# service unmarked fails, in every run); `make test` still runs everything. Three pytest processes side by side, one
# torch/OpenMP thread each: the libraries' tests, the gateway's HTTP-surface areas and the rest of
# the gateway (every test file is in exactly one); each prints its own summary when it is done.
FAST_LANE := not integration and not process and not browser and not slow
FAST_PYTEST := TIERGATE_FAST_LANE=1 OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m "$(FAST_LANE)" \
	-p no:schemathesis -p no:hypothesispytest
FAST_HTTP_AREAS := admin app bench cli db edge jobs security

test-fast: venv
	@$(MAKE) --no-print-directory -j3 --output-sync=target test-fast-libraries test-fast-gateway-http \
		test-fast-gateway-rest

test-fast-libraries:
	$(FAST_PYTEST) tests --ignore=tests/gateway

test-fast-gateway-http:
	$(FAST_PYTEST) $(addprefix tests/gateway/,$(FAST_HTTP_AREAS))

test-fast-gateway-rest:
	$(FAST_PYTEST) tests/gateway $(addprefix --ignore=tests/gateway/,$(FAST_HTTP_AREAS))

# Builds the images, starts deploy/docker-compose.yml, sends traffic through the proxy, kills a
# replica under load and checks the ledger (deploy/smoke.sh; root, docker; not part of `make test`).
deploy-smoke: venv
	bash deploy/smoke.sh

bench-venv:
	test -x .venv-litellm-proxy/bin/python || $(PYTHON) -m venv .venv-litellm-proxy
	.venv-litellm-proxy/bin/pip install -q -c requirements/bench-constraints.txt "litellm[proxy]==1.108.7"

# llama.cpp for `tiergate bench engine` part (e) (bench-only, not part of `make test`; ~10 minutes on two cores):
# the llama.cpp that llama-cpp-python $(LLAMA_CPP_PYTHON) vendors, from its PyPI sdist, built with cmake into
# $(LLAMA_CPP)/build/bin (llama-bench, llama-quantize, llama-simple), and .venv-llama-cpp for its
# convert_hf_to_gguf.py (pins: requirements/bench-llama-cpp.txt). Idempotent: a finished build is kept.
# -march=native, but without AMX: this machine's CPU reports AMX tiles and its VM traps them (SIGILL in ggml's
# AMX q8_0 kernel); the engine has no AMX kernels either. Where AMX works: make bench-llama-cpp LLAMA_CPP_NO_AMX=
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPP_NO_AMX ?= -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP := .bench/llama.cpp
LLAMA_CPP_STAMP := $(LLAMA_CPP)/.tiergate-built-$(LLAMA_CPP_PYTHON)
LLAMA_CPP_VENV := .venv-llama-cpp

bench-llama-cpp: $(LLAMA_CPP_STAMP) $(LLAMA_CPP_VENV)/.tiergate-installed

$(LLAMA_CPP_STAMP):
	mkdir -p .bench/downloads
	test -f .bench/downloads/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz || $(PYTHON) -m pip download -q \
		--disable-pip-version-check --no-binary :all: --no-deps -d .bench/downloads \
		llama-cpp-python==$(LLAMA_CPP_PYTHON)
	rm -rf $(LLAMA_CPP) .bench/unpack && mkdir -p .bench/unpack
	tar -xzf .bench/downloads/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C .bench/unpack
	mv .bench/unpack/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp $(LLAMA_CPP) && rm -rf .bench/unpack
	nice -n 10 cmake -S $(LLAMA_CPP) -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TOOLS=ON \
		-DLLAMA_BUILD_EXAMPLES=ON -DCMAKE_C_FLAGS="$(LLAMA_CPP_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMA_CPP_NO_AMX)"
	nice -n 10 cmake --build $(LLAMA_CPP)/build -j2 --target llama-bench llama-quantize llama-simple
	touch $@

$(LLAMA_CPP_VENV)/.tiergate-installed: requirements/bench-llama-cpp.txt requirements/constraints.txt
	test -x $(LLAMA_CPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_CPP_VENV)
	$(LLAMA_CPP_VENV)/bin/pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r requirements/bench-llama-cpp.txt
	touch $@

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
