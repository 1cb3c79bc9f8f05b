# tiergate: the two commands are `make run` and `make test`; both build .venv from the pins.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tiergate-installed
export LITELLM_LOCAL_MODEL_COST_MAP := True
export TOKENIZERS_PARALLELISM := false

.PHONY: deploy-smoke run test test-fast test-fast-libraries test-fast-gateway-http test-fast-gateway-rest venv lint typecheck imports unit clean bench-venv

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

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
