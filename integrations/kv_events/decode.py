"""Decode the KV-event stream that vLLM, SGLang and TensorRT-LLM publish over ZMQ.

A message is three frames: topic, an 8-byte big-endian sequence number, and a msgpack batch
`[ts, events, dp_rank]` (or a map with those keys). Each event is a map with a `type` key
(vLLM today: `{"type": "BlockStored", "block_hashes": [...], ...}`) or a positional array whose
first item is the type (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, group_idx, ...]`, as older vLLM and other servers send).
Both decode to the same `Stored` / `Removed` / `Cleared`, with what a hybrid model's stream adds
(the KV-cache group that stored a block, its kind and sliding window), the tier's locality and
the extra keys a block's hash covers (LoRA, cache salt). An offloading tier's store may carry no
tokens and a block size of 0 (vLLM's OffloadingConnector, unless its events are self-describing).
Keys it does not know are ignored;
optional fields of the wrong type read as absent; a frame that cannot be read raises
`FrameError`, an event that cannot be read is counted as unknown, never more.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvscope_contract.snapshot_codec import hash_hex

MEDIUM_GPU = "GPU"


class FrameError(ValueError):
    """A frame that is not a KV-event batch (the message says why)."""


def vllm_hash_hex(h: Any) -> str:
    """A block hash in any form vLLM publishes it, as 16 hex digits (ints through the contract's
    `hash_hex`): the low 64 bits, which is what vLLM publishes as an int
    by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), so raw bytes and ints read the same."""
    if isinstance(h, bool):
        raise FrameError(f"a block hash cannot be {h!r}")
    if isinstance(h, int):
        return hash_hex(h)
    if isinstance(h, (bytes, bytearray, memoryview)):
        return f"{int.from_bytes(bytes(h)[-8:], 'big'):016x}"
    if isinstance(h, str) and h:
        return h
    raise FrameError(f"a block hash must be an int or bytes, got {type(h).__name__}")


@dataclass
class Stored:
    hashes: list[str]
    parent: str | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    group: int | None = None            # the KV-cache group that stored them (group_idx; a hybrid model has several)
    spec_kind: str | None = None        # that group's kind: "full_attention", "sliding_window", ...
    sliding_window: int | None = None   # its window in tokens, for a sliding-window group
    locality: str | None = None         # LOCAL or REMOTE to the publisher (an offloading tier); None: unsaid
    # per block: what its hash covers beyond the tokens (LoRA, cache salt, ...)
    extra_keys: list[tuple | None] | None = None
    lora: str | None = None             # the LoRA adapter whose K/V these are (lora_name, or lora_id)


@dataclass
class Removed:
    hashes: list[str]
    medium: str = MEDIUM_GPU
    group: int | None = None
    locality: str | None = None


@dataclass
class Cleared:
    medium: str | None = None  # None: every medium


KVEvent = Stored | Removed | Cleared


@dataclass
class Batch:
    seq: int
    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None
    unknown: list[str] = field(default_factory=list)  # why each skipped event was skipped


# Field order of the positional (array) encoding, after the type tag (vLLM's BlockStored and
# BlockRemoved structs, 0.27 to 0.33; later releases append fields, which are ignored).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")


def _as_map(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))


def _int(v: Any) -> int | None:
    """An optional int field: None when absent or not an int (metadata never fails an event)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _frozen(v: Any) -> Any:
    """msgpack gives arrays as lists: nested tuples, so extra keys can be compared and hashed."""
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def _extra_keys(v: Any, n: int) -> list[tuple | None] | None:
    """One entry per block (None: nothing beyond the tokens), or None when absent or malformed."""
    if not isinstance(v, list) or len(v) != n:
        return None
    return [None if k is None else _frozen(k) if isinstance(k, (list, tuple)) else (k,) for k in v]


def _event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        kind = raw[0]
    else:
        raise FrameError(f"an event must be a map or an array, got {type(raw).__name__}")
    if kind == "BlockStored":
        m = _as_map(raw, _STORED_FIELDS)
        hashes, tokens, size = m.get("block_hashes"), m.get("token_ids") or [], m.get("block_size")
        if not isinstance(hashes, list) or not isinstance(size, int) or size < 0 or (size == 0 and tokens):
            raise FrameError("BlockStored needs block_hashes (a list) and block_size (> 0, or 0 without "
                             "token_ids: an offloading tier's announcement)")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise FrameError("BlockStored token_ids must be a list of ints")
        parent = m.get("parent_block_hash")
        lora = _str(m.get("lora_name")) or (str(i) if (i := _int(m.get("lora_id"))) is not None else None)
        return Stored([vllm_hash_hex(h) for h in hashes], None if parent is None else vllm_hash_hex(parent),
                      tokens, size, _str(m.get("medium")) or MEDIUM_GPU, _int(m.get("group_idx")),
                      _str(m.get("kv_cache_spec_kind")), _int(m.get("kv_cache_spec_sliding_window")),
                      _str(m.get("locality")), _extra_keys(m.get("extra_keys"), len(hashes)), lora)
    if kind == "BlockRemoved":
        m = _as_map(raw, _REMOVED_FIELDS)
        if not isinstance(m.get("block_hashes"), list):
            raise FrameError("BlockRemoved needs block_hashes (a list)")
        return Removed([vllm_hash_hex(h) for h in m["block_hashes"]], _str(m.get("medium")) or MEDIUM_GPU,
                       _int(m.get("group_idx")), _str(m.get("locality")))
    if kind == "AllBlocksCleared":
        medium = raw.get("medium") if isinstance(raw, dict) else (raw[1] if len(raw) > 1 else None)
        return Cleared(medium if isinstance(medium, str) else None)
    raise FrameError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes, seq: int = -1) -> Batch:
    """One msgpack batch; events that cannot be read are skipped and listed in `unknown`."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError) as e:
        raise FrameError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise FrameError(f"a batch is [ts, events, dp_rank], got {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise FrameError("a batch needs a numeric ts and a list of events")
    batch = Batch(seq, float(ts), [], rank if isinstance(rank, int) else None)
    for ev in events:
        try:
            batch.events.append(_event(ev))
        except (FrameError, TypeError, IndexError) as e:
            batch.unknown.append(str(e))
    return batch


def decode_frames(frames: list[bytes]) -> Batch:
    """A PUB message `[topic, seq, payload]` (or `[seq, payload]` without a topic frame)."""
    if len(frames) not in (2, 3):
        raise FrameError(f"a message has 3 frames (topic, seq, payload), got {len(frames)}")
    seq_bytes, payload = frames[-2], frames[-1]
    if len(seq_bytes) != 8:
        raise FrameError(f"the sequence frame has {len(seq_bytes)} bytes, not 8")
    return decode_batch(payload, int.from_bytes(seq_bytes, "big", signed=True))
