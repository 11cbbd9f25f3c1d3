"""One forward per engine step over a flat, unpadded batch, with K/V only in the paged cache.

The decoder loop is written here over the Hugging Face model's own weights and modules
(embeddings, rotary embedding, norms' weights, projections), so Llama-family models and Gemma 3
run while everything else goes through `kernels`: q|k|v and gate|up as one GEMM each, the residual
add fused into the next RMSNorm, the q/k norms and rotary embedding fused with the K/V store, then
attention through the block tables. On the CPU those are C++ kernels and oneDNN GEMMs on
pre-packed weights; the arithmetic is the HF modules' own, so fp32 output stays token-identical to
transformers' `generate()`. No Hugging Face KV cache object is involved.

What differs between architectures is decided once, in the prepared `LayerWeights`: Gemma's
norm of the attention's and of the MLP's output (None elsewhere), its norms' weight as 1 + w in
float32, GELU-tanh for SiLU, a rotary embedding per layer type (local and global bases), and a
sliding window on some layers. K/V live in one pool tensor per device,
[layers per KV group, 2, blocks, block size, KV heads, head dim]: layer L writes slot
`slot of L` of the blocks of its group's block table (one group of every layer for a model
without sliding windows: the plain per-layer cache).
"""
from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

import kernels
from kernels.linear import Linear, choose_backend, choose_gemv, into_huge_pages
from engine.model import decode_step
from engine.model.model_loader import LoadedModel, default_cache_dir, stderr_progress
from kvscope_contract import kv_groups
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
    post_norm: torch.Tensor   # the norm before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward)
    eps: float
    qkv: Linear
    o: Linear
    gate_up: Linear | None    # None: an activation without a fused kernel; `mlp` runs as HF wrote it
    act: Callable | None      # kernels.silu_and_mul or kernels.gelu_tanh_and_mul on gate|up
    down: Linear
    scaling: float            # the attention's softmax scale
    q_norm: torch.Tensor | None  # per-head norms of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None
    input_pre: torch.Tensor | None  # Gemma: the previous layer's norm of its MLP output, before the residual add
    attn_out_norm: torch.Tensor | None  # Gemma: the norm of the attention's output, before the residual add
    mlp: torch.nn.Module
    rope: str | None          # the layer type whose rotary embedding it takes (Gemma: local and global bases)
    window: int               # its sliding window in tokens (0: full attention)


@dataclass
class Prepared:
    layers: list[LayerWeights]
    lm_head: Linear
    final_norm: torch.Tensor
    final_pre: torch.Tensor | None  # Gemma: the last layer's norm of its MLP output
    eps: float
    ropes: list[str | None]   # the rotary embeddings a step computes


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ACTIVATIONS = {"silu": kernels.silu_and_mul, "swish": kernels.silu_and_mul,
                "gelu_pytorch_tanh": kernels.gelu_tanh_and_mul}


def load_cpu_kernels(progress=stderr_progress) -> bool:
    """The C++ CPU kernels, built for this machine on first use (`make install` does it ahead)."""
    return kernels.cpu_build.load(default_cache_dir() / "kernels", progress)


def _norm_weight(norm: torch.nn.Module | None, unit_offset: bool) -> torch.Tensor | None:
    """A norm's weight as kernels.rms_norm takes it: Gemma's 1 + w in float32 (its module's own
    arithmetic: kernels/pointwise.py), else the weight itself."""
    if norm is None:
        return None
    return 1.0 + norm.weight.detach().float() if unit_offset else norm.weight.detach()


def _prepare(model: torch.nn.Module, gemv_dtype: torch.dtype | None, windows: list[int | None]) -> Prepared:
    """The step's weights; gemv_dtype: a copy of them in that dtype for the GEMV (None: theirs)."""
    cfg = model.config
    gemma = cfg.model_type == "gemma3_text"
    act = _ACTIVATIONS.get(getattr(cfg, "hidden_activation", None) or cfg.hidden_act)
    types = getattr(cfg, "layer_types", None) if gemma else None  # Gemma's rotary embedding per layer type
    layers, mlp_out = [], None
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        backend = (*choose_backend(qkv + [attn.o_proj] + gate_up + [mlp.down_proj], gemv_dtype=gemv_dtype),
                   gemv_dtype)  # (name, gemv, gemv_dtype)
        norm = lambda m: _norm_weight(m, gemma)  # noqa: E731
        layers.append(LayerWeights(
            input_norm=norm(layer.input_layernorm),
            post_norm=norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
            eps=_eps(layer.input_layernorm), qkv=Linear(qkv, *backend), o=Linear([attn.o_proj], *backend),
            gate_up=Linear(gate_up, *backend) if act else None, act=act, down=Linear([mlp.down_proj], *backend),
            scaling=attn.scaling, q_norm=norm(getattr(attn, "q_norm", None)),
            k_norm=norm(getattr(attn, "k_norm", None)),
            input_pre=mlp_out, attn_out_norm=norm(layer.post_attention_layernorm) if gemma else None, mlp=mlp,
            rope=types[i] if types else None, window=windows[i] or 0))
        mlp_out = norm(layer.post_feedforward_layernorm) if gemma else None
    lm_head = Linear([model.lm_head], *choose_backend([model.lm_head], gemv_dtype=gemv_dtype), gemv_dtype)
    # per kind of layer: the fastest way differs by shape (kernels/linear.py); the layers' kinds as GEMVs
    # where a decode step can run them in one call (decode_step.py: 1.2-1.8x the ops, GEMMs among them)
    one_call = decode_step.fits(layers)
    for kind in zip(*[(w.qkv, w.o, w.down) + ((w.gate_up,) if w.gate_up else ()) for w in layers]):
        choose_gemv(list(kind), gemm=not one_call)
    choose_gemv([lm_head])
    # the operands a decode step streams, each way chosen, into 2 MB pages: 1.01-1.23x the decode
    # (kernels/huge_pages.py)
    into_huge_pages(step_linears(layers, lm_head), model.parameters())
    return Prepared(layers, lm_head, _norm_weight(model.model.norm, gemma), mlp_out, _eps(model.model.norm),
                    list(dict.fromkeys(w.rope for w in layers)))


def step_linears(layers: list[LayerWeights], lm_head: Linear) -> list[Linear]:
    """Every Linear of a step, layer by layer (q|k|v, o, gate|up, down), then the lm_head."""
    return [lin for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down) if lin] + [lm_head]


def _eps(norm: torch.nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


def _group_layers(pool: PoolConfig, num_layers: int) -> list[list[int]]:
    """The model layers of each KV group of the pool (one group of every layer where it names none)."""
    return [list(g.layers) for g in pool.kv_groups] or [list(range(num_layers))]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, pool: PoolConfig, memory_fraction: float = 0.5):
        self.loaded = loaded
        self.model = loaded.model
        cfg = self.model.config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.windows = [w or 0 for w in (loaded.layer_kinds or [None] * self.num_layers)]
        self.memory_fraction = memory_fraction
        self.kv_cache = self.host_cache = self.offload_cache = None
        self.allocate(pool)
        if self.device.type == "cpu":
            load_cpu_kernels()
        if self.model not in _PREPARED:  # one packed copy per model, shared by every engine on it
            gemv_dtype = None if loaded.gemv_dtype == self.dtype else loaded.gemv_dtype
            _PREPARED[self.model] = _prepare(self.model, gemv_dtype, self.windows)
        self.prepared: Prepared = _PREPARED[self.model]
        self.layers, self.lm_head = self.prepared.layers, self.prepared.lm_head
        self.layer_rope = [self.prepared.ropes.index(w.rope) for w in self.layers]  # for decode_step

    def info(self) -> EngineInfo:
        copy = self.lm_head.gemv and self.loaded.gemv_dtype != self.dtype  # the GEMV's own dtype (float32+bfloat16)
        return EngineInfo(model=self.loaded.name, device=str(self.device),
                          dtype=str(self.dtype).removeprefix("torch."), num_layers=self.num_layers,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                          kernels=(kernels.cpu_build.isa() or "torch") if self.device.type == "cpu" else None,
                          gemv_dtype=str(self.loaded.gemv_dtype).removeprefix("torch.") if copy else None)

    def bytes_per_block(self, pool: PoolConfig) -> int:
        """What one block of `pool` holds: one KV group's layers (every layer in a one-group pool)."""
        return kv_groups.bytes_per_block(pool.block_size, pool.kv_groups, self.num_layers, self.num_kv_heads,
                                         self.head_dim, self.dtype.itemsize)

    def check_fits(self, pool: PoolConfig) -> None:
        """Refuse pools that would take more than their share of free memory."""
        per_block = self.bytes_per_block(pool)
        need = per_block * (pool.num_device_blocks + pool.num_host_blocks + pool.num_offload_blocks)
        held = (self.kv_cache.nbytes + self.host_cache.nbytes + self.offload_cache.nbytes
                if self.kv_cache is not None else 0)
        limit = int((_available_memory(self.device) + held) * self.memory_fraction)
        if need > limit:
            raise CommandError(
                "invalid_argument",
                f"the pools would take {need / 2**30:.2f} GiB ({pool.num_device_blocks} + "
                f"{pool.num_host_blocks} + {pool.num_offload_blocks} blocks of {per_block:,} bytes); at most "
                f"{limit / 2**30:.2f} GiB is allowed here: use fewer or smaller blocks")

    def _check_groups(self, groups: list[list[int]]) -> None:
        layers = sorted(i for g in groups for i in g)
        if layers != list(range(self.num_layers)):
            raise CommandError("invalid_argument", f"the pool's KV groups hold layers {layers}; "
                                                   f"the model has layers 0-{self.num_layers - 1}, each in one group")

    def allocate(self, pool: PoolConfig) -> None:
        """(Re)build the device and host caches for `pool` (the model stays loaded)."""
        groups = _group_layers(pool, self.num_layers)
        self._check_groups(groups)
        self.check_fits(pool)
        self.kv_cache = self.host_cache = self.offload_cache = None  # free the old pools before taking new ones
        self.layers_per_group = kv_groups.layers_per_group(pool.kv_groups, self.num_layers)
        shape = (self.layers_per_group, 2, pool.block_size, self.num_kv_heads, self.head_dim)
        make = lambda n, **kw: torch.zeros(shape[:2] + (n,) + shape[2:], dtype=self.dtype, **kw)  # noqa: E731
        self.block_size = pool.block_size
        self.kv_cache = make(pool.num_device_blocks, device=self.device)
        self.host_cache = make(pool.num_host_blocks, pin_memory=self.device.type == "cuda")
        self.offload_cache = make(pool.num_offload_blocks, pin_memory=self.device.type == "cuda")  # the host tier
        # per layer: its slot of the pool tensor, and which of the step's attention metadata it reads
        # (one per group and window: a group's layers share its tables; in a one-group pool of a
        # model with sliding windows, they differ in window)
        slot, meta_of = [0] * self.num_layers, [0] * self.num_layers
        self.step_metas: list[tuple[int, int]] = []  # (group, window) of each metadata a step builds
        for g, layers in enumerate(groups):
            for s, layer in enumerate(layers):
                key = (g, self.windows[layer])
                if key not in self.step_metas:
                    self.step_metas.append(key)
                slot[layer], meta_of[layer] = s, self.step_metas.index(key)
        self.layer_cache = [self.kv_cache[s] for s in slot]
        self.layer_kv = [t for kv in self.layer_cache for t in kv]  # K, V, K, V, ...: decode_step's caches
        self.layer_meta = meta_of

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
        if batch.loads:  # prefix blocks found in the host tier, into their new device blocks
            kernels.swap_blocks(self.offload_cache, self.kv_cache, batch.loads)
        if not batch.rows:
            return None
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables, last_rows = [], [], [], []
        for row in batch.rows:
            seq = row.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + row.num_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            query_lens.append(row.num_tokens)
            seq_lens.append(end)
            tables.append(seq.block_tables)
            if row.completes:
                last_rows.append(len(ids) - 1)
        group_slots: dict[int, list[int]] = {}
        metas = []
        for g, window in self.step_metas:
            group_tables = [t[g] for t in tables]
            if g not in group_slots:
                group_slots[g] = [t[i // bs] * bs + i % bs for t, start, end in
                                  zip(group_tables, (e - q for e, q in zip(seq_lens, query_lens)), seq_lens)
                                  for i in range(start, end)]
            metas.append(kernels.build_attention_metadata(query_lens, seq_lens, group_tables, group_slots[g], bs,
                                                          self.device, window))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        logits = self.forward(as_tensor(ids), as_tensor(positions), metas, as_tensor(last_rows))
        if batch.stores:  # the full blocks this forward computed, to the host tier
            kernels.swap_blocks(self.kv_cache, self.offload_cache, batch.stores)
        return logits

    def _ropes(self, h: torch.Tensor, positions: torch.Tensor) -> dict:
        """cos/sin [T, head_dim] per rotary embedding the layers take (per layer type in Gemma)."""
        rotary = self.model.model.rotary_emb
        out = {}
        for kind in self.prepared.ropes:
            cos, sin = rotary(h, positions[None]) if kind is None else rotary(h, positions[None], kind)
            out[kind] = cos[0], sin[0]
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[kernels.AttentionMetadata],
                logits_rows: torch.Tensor) -> torch.Tensor:
        """metas: the step's attention metadata, one per (group, window) of `step_metas`."""
        prep = self.prepared
        h = self.model.model.embed_tokens(input_ids)  # [T, hidden] (Gemma's module scales it by sqrt(hidden))
        ropes = self._ropes(h, positions)
        residual = h
        x = kernels.rms_norm(h, self.layers[0].input_norm, self.layers[0].eps)
        if decode_step.takes(x, metas) and (args := decode_step.layer_arguments(self.layers)):
            decode_step.run(x, residual, args, self.layer_kv, [ropes[kind] for kind in prep.ropes], self.layer_rope,
                            metas, self.layer_meta, self.model.config.num_attention_heads)
        else:
            x = self._layers(x, residual, ropes, metas)
        if not len(logits_rows):
            return h.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        out = x[logits_rows]
        if prep.final_pre is not None:  # Gemma: the last MLP's output norm
            out = kernels.rms_norm(out, prep.final_pre, prep.eps)
        last = residual[logits_rows] + out
        return self.lm_head(kernels.rms_norm(last, prep.final_norm, prep.eps)).float()

    def _layers(self, x: torch.Tensor, residual: torch.Tensor, ropes: dict,
                metas: list[kernels.AttentionMetadata]) -> torch.Tensor:
        """The decoder layers op by op on x (layer 0's input norm of `residual`), the residual
        stream in place; returns the last layer's MLP output."""
        n, d, kvh = x.shape[0], self.head_dim, self.num_kv_heads
        for i, (w, kv, m) in enumerate(zip(self.layers, self.layer_cache, self.layer_meta)):
            meta = metas[m]
            if i:  # the residual add of the previous layer's MLP, fused into this layer's norm
                kernels.add_rms_norm(x, residual, w.input_norm, w.eps, w.input_pre)
            q, k, v = w.qkv(x).view(n, -1, d).split([w.qkv.out_features // d - 2 * kvh, kvh, kvh], dim=1)
            cos, sin = ropes[w.rope]
            kernels.rope_store(q, k, v, cos, sin, kv[0], kv[1], meta.slot_mapping, w.q_norm, w.k_norm, w.eps)
            o = kernels.paged_attention(q, kv[0], kv[1], meta, w.scaling, key=k, value=v)
            x = w.o(o.view(n, -1))
            kernels.add_rms_norm(x, residual, w.post_norm, w.eps, w.attn_out_norm)
            x = w.down(w.act(w.gate_up(x))) if w.gate_up else w.mlp(x)
        return x


if __name__ == "__main__":  # `python -m engine.model.model_runner`: build the CPU kernels now (make install)
    load_cpu_kernels(print)
    print(f"CPU kernels: {kernels.cpu_build.status()}")
    sys.exit(0)  # without them the engine runs the torch path: not an install failure
