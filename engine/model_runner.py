"""One forward per engine step over a flat, unpadded batch, with K/V only in the paged cache.

The decoder loop is written here over the Hugging Face model's own modules (embeddings,
norms, projections, MLP, rotary embedding), so any Llama-family model runs unchanged while
attention goes through `kernels`: store each new token's K/V by slot, then attend through
the block tables. No Hugging Face KV cache object is involved.
"""
from __future__ import annotations

import torch

import kernels
from engine.model_loader import LoadedModel
from engine.contract.protocol import CommandError, EngineInfo, PoolConfig
from engine.scheduler import Batch


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """fp32 matmuls on the CPU go through oneDNN: torch's default there, MKL's sgemm, ran at
    half its speed on this project's AMD CPUs (bench/throughput.py; docs/benchmarks.md)."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
    return layer(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
        self.allocate(pool)

    def info(self) -> EngineInfo:
        return EngineInfo(model=self.loaded.name, device=str(self.device),
                          dtype=str(self.dtype).removeprefix("torch."), num_layers=self.num_layers,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def bytes_per_block(self, block_size: int) -> int:
        """block_size x layers x kv heads x head dim x 2 (K and V) x bytes per element."""
        return (block_size * self.num_layers * self.num_kv_heads * self.head_dim * 2
                * self.dtype.itemsize)

    def check_fits(self, pool: PoolConfig) -> None:
        """Refuse pools that would take more than their share of free memory."""
        per_block = self.bytes_per_block(pool.block_size)
        need = per_block * (pool.num_device_blocks + pool.num_host_blocks)
        held = self.kv_cache.nbytes + self.host_cache.nbytes if hasattr(self, "kv_cache") else 0
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
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, head_dim]
        n, d = h.shape[0], self.head_dim
        for layer, kv in zip(inner.layers, self.kv_cache):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = _linear(attn.q_proj, x).view(n, -1, d)
            k = _linear(attn.k_proj, x).view(n, -1, d)
            v = _linear(attn.v_proj, x).view(n, -1, d)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kernels.store_kv(k, v, kv[0], kv[1], meta.slot_mapping)
            o = kernels.paged_attention(q, kv[0], kv[1], meta, attn.scaling)
            h = h + _linear(attn.o_proj, o.reshape(n, -1))
            mlp, x = layer.mlp, layer.post_attention_layernorm(h)
            h = h + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))
        if not len(logits_rows):
            return h.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        return _linear(self.model.lm_head, inner.norm(h[logits_rows])).float()
