"""An LLMEngine on a loaded model with a small pool, as the engine tests build it."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.model.engine import LLMEngine
from kvscope_contract import protocol as p


def make(loaded, **pool) -> LLMEngine:
    cfg = EngineConfig(model="tiny", max_num_batched_tokens=pool.pop("max_num_batched_tokens", 1024),
                       pool=p.PoolConfig(**{"num_device_blocks": 128, "num_host_blocks": 64, **pool}))
    return LLMEngine(cfg, loaded)
