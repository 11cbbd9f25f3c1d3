"""One forward per engine step over a flat, unpadded batch, with K/V only in the paged cache.

The decoder loop is written here over the Hugging Face model's own weights and modules
(embeddings, rotary embedding, norms' weights, projections), so any Llama-family model runs
while everything else goes through `kernels`: q|k|v and gate|up as one GEMM each, the residual
add fused into the next RMSNorm, rotary embedding fused with the K/V store, then attention
through the block tables. On the CPU those are C++ kernels and oneDNN GEMMs on pre-packed
weights; the arithmetic is the HF modules' own, so fp32 output stays token-identical to
transformers' `generate()`. No Hugging Face KV cache object is involved.
"""
from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass

import torch

import kernels
from kernels.linear import Linear, choose_backend
from engine.model.model_loader import LoadedModel, default_cache_dir, stderr_progress
from kvscope_contract.protocol import CommandError, EngineInfo, PoolConfig
from engine.core.scheduler import Batch


def _available_memory(device: torch.device) -> int:
    """Bytes free for the pools: the GPU's free memory, Linux's MemAvailable, else (other OSes)
    a quarter of physical memory as a conservative guess."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if sys.platform.startswith("linux"):
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


@dataclass
class LayerWeights:
    """One decoder layer as the step runs it."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: Linear
    o: Linear
    gate_up: Linear | None    # None: the MLP's activation is not SiLU; `mlp` runs as HF wrote it
    down: Linear
    attn: torch.nn.Module     # for q_norm / k_norm (Qwen3) and the scaling
    qk_norm: bool             # attn has q_norm / k_norm (looked up once: a miss on a Module is slow)
    mlp: torch.nn.Module


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_cpu_kernels(progress=stderr_progress) -> bool:
    """The C++ CPU kernels, built for this machine on first use (`make install` does it ahead)."""
    return kernels.cpu_build.load(default_cache_dir() / "kernels", progress)


def _prepare(model: torch.nn.Module, gemv_dtype: torch.dtype | None) -> tuple[list[LayerWeights], Linear]:
    """The step's weights; gemv_dtype: a copy of them in that dtype for the GEMV (None: theirs)."""
    layers = []
    silu = model.config.hidden_act in ("silu", "swish")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        backend = (*choose_backend(qkv + [attn.o_proj] + gate_up + [mlp.down_proj], gemv_dtype=gemv_dtype),
                   gemv_dtype)  # (name, gemv, gemv_dtype)
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
            eps=layer.input_layernorm.variance_epsilon, qkv=Linear(qkv, *backend), o=Linear([attn.o_proj], *backend),
            gate_up=Linear(gate_up, *backend) if silu else None, down=Linear([mlp.down_proj], *backend),
            attn=attn, qk_norm=hasattr(attn, "q_norm"), mlp=mlp))
    return layers, Linear([model.lm_head], *choose_backend([model.lm_head], gemv_dtype=gemv_dtype), gemv_dtype)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: PoolConfig, memory_fraction: float = 0.5):
        self.loaded = loaded
        self.model = loaded.model
        cfg = self.model.config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.memory_fraction = memory_fraction
        self.kv_cache = self.host_cache = None
        self.allocate(pool)
        if self.device.type == "cpu":
            load_cpu_kernels()
        if self.model not in _PREPARED:  # one packed copy per model, shared by every engine on it
            _PREPARED[self.model] = _prepare(self.model, None if loaded.gemv_dtype == self.dtype else loaded.gemv_dtype)
        self.layers, self.lm_head = _PREPARED[self.model]

    def info(self) -> EngineInfo:
        copy = self.lm_head.packed  # the GEMV streams its own copy of the weights (float32+bfloat16)
        return EngineInfo(model=self.loaded.name, device=str(self.device),
                          dtype=str(self.dtype).removeprefix("torch."), num_layers=self.num_layers,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                          kernels=(kernels.cpu_build.isa() or "torch") if self.device.type == "cpu" else None,
                          gemv_dtype=str(self.loaded.gemv_dtype).removeprefix("torch.") if copy else None)

    def bytes_per_block(self, block_size: int) -> int:
        """block_size x layers x kv heads x head dim x 2 (K and V) x bytes per element."""
        return (block_size * self.num_layers * self.num_kv_heads * self.head_dim * 2
                * self.dtype.itemsize)

    def check_fits(self, pool: PoolConfig) -> None:
        """Refuse pools that would take more than their share of free memory."""
        per_block = self.bytes_per_block(pool.block_size)
        need = per_block * (pool.num_device_blocks + pool.num_host_blocks)
        held = self.kv_cache.nbytes + self.host_cache.nbytes if self.kv_cache is not None else 0
        limit = int((_available_memory(self.device) + held) * self.memory_fraction)
        if need > limit:
            raise CommandError(
                "invalid_argument",
                f"the pools would take {need / 2**30:.2f} GiB ({pool.num_device_blocks} + "
                f"{pool.num_host_blocks} blocks of {per_block:,} bytes); at most "
                f"{limit / 2**30:.2f} GiB is allowed here: use fewer or smaller blocks")

    def allocate(self, pool: PoolConfig) -> None:
        """(Re)build the device and host caches for `pool` (the model stays loaded)."""
        self.check_fits(pool)
        self.kv_cache = self.host_cache = None  # free the old pools before taking new ones
        shape = (self.num_layers, 2, pool.block_size, self.num_kv_heads, self.head_dim)
        make = lambda n, **kw: torch.zeros(shape[:2] + (n,) + shape[2:], dtype=self.dtype, **kw)
        self.block_size = pool.block_size
        self.kv_cache = make(pool.num_device_blocks, device=self.device)
        self.host_cache = make(pool.num_host_blocks, pin_memory=self.device.type == "cuda")

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor | None:
        """Copy blocks as the scheduler decided, then run the batch; returns the logits
        (float32) of the rows whose chunk completes a sequence, in batch order."""
        if batch.swap_out:  # first: the blocks they free may be reused in this very step
            kernels.swap_blocks(self.kv_cache, self.host_cache, batch.swap_out)
        if batch.swap_in:
            kernels.swap_blocks(self.host_cache, self.kv_cache, batch.swap_in)
        if batch.copies:
            kernels.copy_blocks(self.kv_cache, batch.copies)
        if not batch.rows:
            return None
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables, last_rows = [], [], [], []
        for row in batch.rows:
            seq = row.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + row.num_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[i // bs] * bs + i % bs for i in range(start, end)]
            query_lens.append(row.num_tokens)
            seq_lens.append(end)
            tables.append(table)
            if row.completes:
                last_rows.append(len(ids) - 1)
        meta = kernels.build_attention_metadata(query_lens, seq_lens, tables, slots, bs, self.device)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        return self.forward(as_tensor(ids), as_tensor(positions), meta, as_tensor(last_rows))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: kernels.AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        h = inner.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = inner.rotary_emb(h, positions[None])
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        n, d, kvh = h.shape[0], self.head_dim, self.num_kv_heads
        residual = h
        x = kernels.rms_norm(h, self.layers[0].input_norm, self.layers[0].eps)
        for i, (w, kv) in enumerate(zip(self.layers, self.kv_cache)):
            if i:  # the residual add of the previous layer's MLP, fused into this layer's norm
                kernels.add_rms_norm(x, residual, w.input_norm, w.eps)
            q, k, v = w.qkv(x).view(n, -1, d).split([w.qkv.out_features // d - 2 * kvh, kvh, kvh], dim=1)
            if w.qk_norm:  # Qwen3 normalises q and k per head
                q, k = w.attn.q_norm(q), w.attn.k_norm(k)
            kernels.rope_store(q, k, v, cos, sin, kv[0], kv[1], meta.slot_mapping)
            o = kernels.paged_attention(q, kv[0], kv[1], meta, w.attn.scaling, key=k, value=v)
            x = w.o(o.view(n, -1))
            kernels.add_rms_norm(x, residual, w.post_norm, w.eps)
            x = w.down(kernels.silu_and_mul(w.gate_up(x))) if w.gate_up else w.mlp(x)
        if not len(logits_rows):
            return h.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        last = residual[logits_rows] + x[logits_rows]
        return self.lm_head(kernels.rms_norm(last, inner.norm.weight, inner.norm.variance_epsilon)).float()


if __name__ == "__main__":  # `python -m engine.model.model_runner`: build the CPU kernels now (make install)
    load_cpu_kernels(print)
    print(f"CPU kernels: {kernels.cpu_build.status()}")
    sys.exit(0)  # without them the engine runs the torch path: not an install failure
