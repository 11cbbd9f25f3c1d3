from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm_smoke: the plugin, the launcher and the KV events on a real vLLM, "
                                       "what `make test-vllm-smoke` runs on another release")
