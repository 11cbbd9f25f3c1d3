from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm_smoke: the plugin, the launcher and the KV events on a real vLLM, "
                                       "what `make test-vllm-smoke` runs on another release")


@pytest.fixture
def dashboard(monkeypatch):
    """start(**env) -> the dashboard (AppTest of app/main.py) with that environment, run once."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from tests.vllm.vllm_server import ROOT

    def start(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        st.cache_resource.clear()
        at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=30)
        return at.run()

    yield start
    st.cache_resource.clear()
