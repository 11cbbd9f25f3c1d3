"""Engine configuration: the allocator's pool config (on the wire) plus engine-only knobs."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from engine.core.block_manager import WATERMARK
from kvscope_contract.protocol import PoolConfig


@dataclass
class EngineConfig:
    model: str = "smollm2"        # "smollm2", "gemma3" (bundled), "tiny", "tiny-gemma3" (random, for tests) or a folder
    device: str | None = None     # None: cuda if available, else cpu
    dtype: str | None = None      # None: bfloat16 on cuda and on CPUs with AVX512-BF16 or AMX, else float32+bfloat16
    pool: PoolConfig = field(default_factory=PoolConfig)
    max_num_batched_tokens: int = 1024  # tokens per forward; longer prompts are prefilled in chunks
    watermark: float = WATERMARK  # fraction of device blocks kept free when admitting new work
    memory_fraction: float = 0.5  # largest share of free memory the two pools may take


def add_engine_args(ap) -> None:
    """The command-line flags that build an EngineConfig (shared by every entry point)."""
    d, pool = EngineConfig(), PoolConfig()
    ap.add_argument("--model", default=d.model,
                    help="'smollm2' or 'gemma3' (bundled: SmolLM2-135M, Gemma 3 270M), 'tiny' or 'tiny-gemma3' "
                         "(random, for tests) or a local HF folder (Llama, Mistral, Qwen2/3, Gemma 3)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or float32+bfloat16 (fp32 with "
                    "bf16 weights for the CPU GEMV); default: bfloat16 on cuda and on CPUs with AVX512-BF16 "
                    "or AMX, else float32+bfloat16")
    ap.add_argument("--block-size", type=int, default=pool.block_size)
    ap.add_argument("--num-device-blocks", type=int, default=pool.num_device_blocks)
    ap.add_argument("--num-host-blocks", type=int, default=pool.num_host_blocks)
    ap.add_argument("--host-blocks", type=int, default=pool.num_offload_blocks, metavar="N",
                    help="blocks of the host tier: full blocks are stored there as they complete, and a prefix "
                         "that misses on the device is loaded from there (docs/offload.md; 0: no host tier)")
    ap.add_argument("--max-num-seqs", type=int, default=pool.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    ap.add_argument("--preemption-mode", choices=["swap", "recompute"], default=pool.preemption_mode)
    ap.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    ap.add_argument("--pool", default=None, metavar="JSON",
                    help="the whole pool config as JSON, as `hello` sends it (overrides the pool flags; "
                         "the dashboard restarts a dead engine with its last config this way)")


def config_from_args(args) -> EngineConfig:
    pool = PoolConfig(block_size=args.block_size, num_device_blocks=args.num_device_blocks,
                      num_host_blocks=args.num_host_blocks, max_num_seqs=args.max_num_seqs,
                      num_offload_blocks=args.host_blocks, preemption_mode=args.preemption_mode,
                      enable_prefix_caching=not args.no_prefix_caching)
    if args.pool:
        pool = msgspec.json.decode(args.pool, type=PoolConfig)
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, pool=pool,
                        max_num_batched_tokens=args.max_num_batched_tokens)
