"""KVScope's vLLM plugin (entry point `vllm.general_plugins: kvscope`), inert unless enabled.

vLLM calls `register()` in each of its processes. With KVSCOPE_PORT set, every vLLM scheduler
built afterwards (the engine core's) gets a PoolObserver, and a KVScope WebSocket server starts
in that process on KVSCOPE_HOST:KVSCOPE_PORT (default 127.0.0.1; port 0 picks a free one;
KVSCOPE_TOKEN is required beyond loopback; KVSCOPE_VIEW_TOKEN, beside it, views and never commands).
Submits go to vLLM's OpenAI server at
KVSCOPE_VLLM_URL (default http://127.0.0.1:8000). See docs/vllm.md.
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("kvscope")
ENV_PORT, ENV_HOST, ENV_API = "KVSCOPE_PORT", "KVSCOPE_HOST", "KVSCOPE_VLLM_URL"


def register() -> None:
    if not os.environ.get(ENV_PORT):
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.__init__, "kvscope", False):
        return
    original = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        attach(self)

    __init__.kvscope = True
    Scheduler.__init__ = __init__


def attach(scheduler) -> None:
    """Observe `scheduler` and serve it; any failure is logged and leaves vLLM as it was."""
    from engine.serve.cli import refuse_open_bind
    from engine.serve.admission import Admission
    from engine.serve.hub import Hub, serve_in_thread
    from integrations.vllm import ADMIT_BURST, ADMIT_PER_S
    from kvscope_contract.access import TOKEN_ENV, VIEW_TOKEN_ENV
    from kvscope_contract.ready import ready_line
    from integrations.vllm.backend import VllmBackend
    from integrations.vllm.observer import UnsupportedEngine

    host, token = os.environ.get(ENV_HOST, "127.0.0.1"), os.environ.get(TOKEN_ENV) or None
    view_token = os.environ.get(VIEW_TOKEN_ENV) or None  # with a token: one that views (events, /metrics)
    if not (value := os.environ.get(ENV_PORT)):  # a process forked from one that had it set
        return
    try:
        port = int(value)
    except ValueError:
        log.error("kvscope: %s must be a port number, got %r", ENV_PORT, value)
        return
    if refuse_open_bind(host, token):
        return
    rank = scheduler.vllm_config.parallel_config.data_parallel_index
    if port and rank:
        port += rank  # one server per data-parallel engine core, as vLLM offsets its KV-event port
    try:
        backend = VllmBackend(scheduler, os.environ.get(ENV_API, "http://127.0.0.1:8000"))
        admission = Admission(rate=ADMIT_PER_S, burst=ADMIT_BURST)
        serving = serve_in_thread(Hub(backend, token=token, view_token=view_token, admission=admission), host, port)
    except UnsupportedEngine as e:
        return refuse(str(e))
    except Exception as e:
        log.exception("kvscope: not observing this vLLM")
        return refuse(f"the plugin failed to attach ({type(e).__name__}: {e}); vLLM runs on, unobserved")
    backend.stop_serving = serving.request_stop
    original_shutdown = scheduler.shutdown

    def shutdown() -> None:
        serving.stop()
        original_shutdown()

    scheduler.shutdown = shutdown
    cfg = backend.config
    print("[kvscope] " + ready_line(serving.url, f"observing vLLM's pool of {cfg.num_device_blocks} blocks "
                                    f"of {cfg.block_size} tokens ({backend.info.model})"), file=sys.stderr, flush=True)


def refuse(why: str) -> None:
    """Say, in vLLM's log and to the dashboard that started it (its launcher reads this line),
    why this vLLM is not observed; vLLM itself runs on."""
    from kvscope_contract.ready import refused_line

    log.error("kvscope: %s", why)
    print("[kvscope] " + refused_line(why), file=sys.stderr, flush=True)
