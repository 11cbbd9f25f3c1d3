"""Fixtures every kind of test shares: the tiny model and a factory of in-process engine servers.
Each folder's conftest.py adds its own (integration: an engine server and the app under AppTest
on it; browser: the app started for chromium; unit: each C++ kernel variant).

Tests share helpers through modules here that are not test files, never by importing another
test module: protocol_client.py (the one protocol client, over app/link/wire.py), waiting.py,
apptest.py (driving the app under AppTest), synthetic.py (synthetic engines, in process or as
servers), tiny_engine.py, pool_driver.py and histories.py (pools under pressure), grid_canvas.py
(what the grid's canvas does with a message), attention_cases.py and cpu_variants.py (kernels),
kv_event_stream.py (a ZMQ KV-event stream), grafana_board.py, perfetto_trace.py, prompts.py,
processes.py, lesson_claims.py; tools/launch.py opens the app's page for a browser test as for the
screenshots."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: needs the real model or takes more than ~10 s "
                                       "(deselect with -m 'not slow')")
    config.addinivalue_line("markers", "vllm: needs a real vLLM in .venv-vllm (`make test-vllm`)")
    config.addinivalue_line("markers", "wheel: builds the wheel and installs it into a fresh venv (`make test-wheel`)")


@pytest.fixture(scope="session")
def tiny():
    """The random 2-layer Llama in fp32, the exact reference (tokens equal transformers'), on
    the default device; loaded once per run."""
    from engine.model.model_loader import load_model
    return load_model("tiny", dtype="float32")


@pytest.fixture
def serve_engine() -> Iterator[Callable]:
    """serve_engine(engine, **kw) -> a running server (engine.serve.server.start_in_thread's
    Serving: .url, .stop()); every server started is stopped after the test."""
    from engine.serve.server import start_in_thread
    servers = []

    def start(engine, **kw):
        servers.append(start_in_thread(engine, **kw))
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()
