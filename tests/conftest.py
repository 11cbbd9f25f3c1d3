import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: needs the real model or takes more than ~10 s "
                                       "(deselect with -m 'not slow')")
    config.addinivalue_line("markers", "vllm: needs a real vLLM in .venv-vllm (`make test-vllm`)")
    config.addinivalue_line("markers", "wheel: builds the wheel and installs it into a fresh venv (`make test-wheel`)")
