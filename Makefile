# Set-up and test entry points. `make serve` and `make test` work on a fresh clone (CPU machine).
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 30000
ARGS ?=
PYTEST_ARGS ?=

.PHONY: venv model serve serve-plain test test-fast format

venv:
	@bash scripts/setup_cpu_env.sh

model: venv
	@$(PY) -m spexis_sglang.default_model

# Serve the bundled SmolLM2-135M-Instruct on CPU with two pipeline stages and Spexis on.
serve: model
	$(PY) -m spexis_sglang.launch_server --pp-size 2 --spexis-draft-head bundled --host 127.0.0.1 --port $(PORT) $(ARGS)

# The same model with plain SGLang PP=2 (the baseline).
serve-plain: model
	$(PY) -m spexis_sglang.launch_server --pp-size 2 --host 127.0.0.1 --port $(PORT) $(ARGS)

# The whole test suite (unit + end-to-end against real CPU servers), on two pytest-xdist
# workers: a test file (an end-to-end group: tests/e2e/conftest.py) runs on one of them.
test: model
	$(PY) -m pytest tests -n 2 --dist loadgroup $(PYTEST_ARGS)

# Unit tests only (no servers).
test-fast: venv
	$(PY) -m pytest tests -m "not e2e" $(PYTEST_ARGS)

format: venv
	$(PY) -m black python tests benchmark && $(PY) -m isort python tests benchmark
