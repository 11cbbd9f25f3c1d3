"""A model's layers as KV-cache groups, by vLLM v1's uniform-page-size rule.

A hybrid model repeats a pattern of attention kinds (Gemma 3: five sliding-window layers, then
one full-attention layer). Layers of one kind are split into groups of equal size, the size of
the smallest kind's bucket (its largest when no bucket has 1.5 times as many layers), so that
one physical block holds the K/V of as many layers whichever group it serves and a single pool
serves them all. A bucket that does not divide evenly is padded (its last group's extra slots
hold nothing), as vLLM pads it. Each group takes every n-th layer of its bucket (layers[i::n]),
as vLLM does, so groups spread over the model's depth.
"""
from __future__ import annotations

from kvscope_contract.protocol import KVGroup


def group_layers(windows: list[int | None]) -> list[KVGroup]:
    """The KV-cache groups of a model whose layer i attends to its last `windows[i]` tokens
    (None: full attention), in vLLM's group order (buckets in order of their first layer)."""
    if not windows:
        raise ValueError("a model has at least one attention layer")
    buckets: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        buckets.setdefault(window, []).append(layer)
    if len(buckets) == 1 and None in buckets:
        return []  # one full-attention group over every layer: the protocol's default
    sizes = [len(layers) for layers in buckets.values()]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups = []
    for window, layers in buckets.items():
        n = -(-len(layers) // size)
        kind = "full_attention" if window is None else "sliding_window"
        groups += [KVGroup(kind=kind, sliding_window=window, layers=layers[i::n]) for i in range(n)]
    return groups


def layers_per_group(groups: list[KVGroup], num_layers: int) -> int:
    """Layers whose K/V one block holds: the groups' common size, padding included."""
    return max((len(g.layers) for g in groups), default=0) or num_layers


def bytes_per_block(block_size: int, groups: list[KVGroup], num_layers: int, num_kv_heads: int,
                    head_dim: int, itemsize: int) -> int:
    """block_size x layers per group x KV heads x head dim x 2 (K and V) x bytes per element:
    what one block of any group holds (a full-attention model's one group has every layer)."""
    return block_size * layers_per_group(groups, num_layers) * num_kv_heads * head_dim * 2 * itemsize


def gemma3_groups(window: int = 512) -> list[KVGroup]:
    """Gemma 3 270M's groups: 18 layers, every sixth full attention, the rest a sliding window
    (512 tokens in the real model): 5 sliding-window groups and 1 full, 3 layers each."""
    return group_layers([None if (i + 1) % 6 == 0 else window for i in range(18)])


def describe(groups: list[KVGroup]) -> str:
    """"5 sliding-window (512) + 1 full-attention groups of 3 layers", for status lines."""
    if not groups:
        return "1 full-attention group"
    kinds: dict[str, int] = {}
    for g in groups:
        name = f"sliding-window ({g.sliding_window})" if g.kind == "sliding_window" else "full-attention"
        kinds[name] = kinds.get(name, 0) + 1
    words = " + ".join(f"{n} {name}" for name, n in kinds.items())
    return f"{words} group{'s' if len(groups) > 1 else ''} of {len(groups[0].layers)} layers"
