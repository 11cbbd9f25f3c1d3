"""An LLMEngine on a loaded model with a small pool, as the engine tests build it."""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from engine.config import EngineConfig
from engine.model.engine import LLMEngine
from kvscope_contract import protocol as p


def make(loaded, **pool) -> LLMEngine:
    cfg = EngineConfig(model="tiny", max_num_batched_tokens=pool.pop("max_num_batched_tokens", 1024),
                       pool=p.PoolConfig(**{"num_device_blocks": 128, "num_host_blocks": 64, **pool}))
    return LLMEngine(cfg, loaded)


def hf_greedy(loaded, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generate() on the same model: the reference the engine must equal."""
    out = loaded.model.generate(
        torch.tensor([prompt_ids], device=loaded.device), attention_mask=None,
        generation_config=GenerationConfig(max_new_tokens=max_new, do_sample=False,
                                           eos_token_id=None, pad_token_id=0))
    return out[0, len(prompt_ids):].tolist()
