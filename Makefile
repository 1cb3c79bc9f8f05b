# tiergate: the two commands are `make run` and `make test`; both build .venv from the pins.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tiergate-installed
export LITELLM_LOCAL_MODEL_COST_MAP := True
export TOKENIZERS_PARALLELISM := false

.PHONY: run test venv lint typecheck imports unit clean bench-venv

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

bench-venv:
	test -x .venv-litellm-proxy/bin/python || $(PYTHON) -m venv .venv-litellm-proxy
	.venv-litellm-proxy/bin/pip install -q -c requirements/bench-constraints.txt "litellm[proxy]==1.108.7"

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
