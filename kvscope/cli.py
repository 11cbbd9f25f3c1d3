"""The commands a pip install gives (pyproject.toml's scripts) and the vLLM plugin's entry point,
named through `kvscope` so that they resolve in the wheel and in a checkout alike."""
from __future__ import annotations


def dashboard() -> None:
    from app.__main__ import main
    main()


def engine_server() -> int:
    from engine.serve.server import main
    return main()


def replay() -> int:
    from engine.serve.replay import main
    return main()


def generate() -> int:
    from engine.model.generate import main
    return main()


def export() -> int:
    from app.export.perfetto import main
    return main()


def explain() -> int:
    from engine.lab.explain import main
    return main()


def vllm_plugin() -> None:
    """vLLM calls it in each of its processes (entry point `vllm.general_plugins: kvscope`)."""
    from integrations.vllm.plugin import register
    register()
