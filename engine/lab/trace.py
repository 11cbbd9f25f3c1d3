"""Request traces in the Mooncake format (FAST'25), read line by line and checked.

One JSON object per line, in arrival order (docs/traces.md):

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ..., 13]}

`timestamp`: arrival in ms from the trace's start; `input_length`: prompt tokens; `output_length`:
tokens generated; `hash_ids`: one id per 512-token block of the prompt (the last one partial),
prefix-chained: an id names its block together with every block before it, so two prompts share
KV for 512 x (their common leading ids) tokens. The trace carries no tokens: the ids *are* the
content.

`read_trace` streams the requests (one line decoded at a time) and raises `TraceError`, naming the
file and line, at the first line that breaks a rule; `scan` reads the whole file once that way
before anything runs (so a bad line never leaves a half-run sweep) and keeps what a replay needs
in compact arrays: the future uses of each id (for OPT) and the exact reuse ceiling.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import msgspec
import numpy as np

TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces
# a hash id is a prompt token when a trace is played over the protocol, whose token ids are uint32;
# the one above is the replay's output token
MAX_HASH_ID = 2 ** 32 - 2


class TraceError(ValueError):
    """A trace that breaks a rule of the format; the message names the file and the line."""


class TraceRequest(msgspec.Struct, frozen=True):
    """One line of a trace (the index is its line number less one)."""
    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


_decode = msgspec.json.Decoder(TraceRequest).decode


def check_block_size(block_size: int, path: Path | str = "") -> None:
    """An engine block must lie inside one trace block: its size divides 512."""
    if block_size < 1 or TRACE_BLOCK % block_size:
        raise TraceError(f"{path}: block size {block_size} does not divide the trace's {TRACE_BLOCK}-token "
                         f"blocks: use a divisor of {TRACE_BLOCK} (1, 2, 4, ..., 256, 512)")


def read_trace(path: Path | str, limit: int | None = None) -> Iterator[TraceRequest]:
    """The trace's requests, the first `limit` of them (None: all), each checked as it is read.

    Raises:
        TraceError: at the first bad line, naming `path:line` and the rule: not a JSON object of
            the four fields with their types; a length below 1, an id outside 0 to 2**32 - 2; a
            timestamp before the previous one; `len(hash_ids) != ceil(input_length / 512)`; a hash
            chain that contradicts itself (an id seen before following an id never seen, or an id
            seen before under another parent: prefix-chained ids make both impossible).
        OSError: the file cannot be read.
    """
    parent: dict[int, int] = {}  # id -> the id before it in its chain (-1: the first block)
    last_t = None
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and n > limit:
                return
            if not line.strip():
                raise TraceError(f"{path}:{n}: an empty line (one JSON object per line)")
            try:
                r = _decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise TraceError(f"{path}:{n}: {e}") from None
            where = f"{path}:{n}"
            if r.input_length < 1 or r.output_length < 1:
                raise TraceError(f"{where}: input_length and output_length must be at least 1, got "
                                 f"{r.input_length} and {r.output_length}")
            if last_t is not None and r.timestamp < last_t:
                raise TraceError(f"{where}: timestamp {r.timestamp} is before the previous line's {last_t} "
                                 "(requests must be in arrival order)")
            last_t = r.timestamp
            want = -(-r.input_length // TRACE_BLOCK)
            if len(r.hash_ids) != want:
                raise TraceError(f"{where}: {len(r.hash_ids)} hash_ids for input_length {r.input_length}: "
                                 f"ceil({r.input_length} / {TRACE_BLOCK}) = {want} expected")
            _check_chain(r.hash_ids, parent, where)
            yield r


def _check_chain(ids: list[int], parent: dict[int, int], where: str) -> None:
    prev, new_at = -1, None
    for i, h in enumerate(ids):
        if not 0 <= h <= MAX_HASH_ID:
            raise TraceError(f"{where}: hash_ids[{i}] = {h}: ids are integers from 0 to {MAX_HASH_ID:,}")
        known = parent.get(h)
        if known is None:
            parent[h] = prev
            new_at = i if new_at is None else new_at
        elif new_at is not None:
            raise TraceError(f"{where}: hash_ids[{i}] = {h} was seen in an earlier request but follows "
                             f"hash_ids[{new_at}] = {ids[new_at]}, never seen before: prefix-chained ids "
                             "cannot (an id names its block with every block before it)")
        elif known != prev:
            raise TraceError(f"{where}: hash_ids[{i}] = {h} follows {prev if prev >= 0 else 'nothing'} here "
                             f"but {known if known >= 0 else 'nothing'} in an earlier request: "
                             "prefix-chained ids cannot")
        prev = h


@dataclass
class TraceIndex:
    """What one checked pass over a trace keeps: its size, the exact reuse ceiling at one engine
    block size, and when each hash id is used (for OPT), in arrays of a few bytes per id.

    The ceiling is what an unlimited pool serving one request at a time would hit: for each
    request, its leading engine blocks whose content an earlier request's prompt held in full
    (an id's block as far as an earlier prompt reached into it), never the block holding the
    prompt's last token (the allocator's rule: the last token is computed).
    """
    path: str
    block_size: int
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    blocks_needed: int = 0        # sum over requests of ceil((input + output) / block size): a pool never evicting
    largest_request: int = 0      # blocks of the longest request (prompt + output)
    ceiling_hit_tokens: int = 0
    first_timestamp: float = 0.0
    last_timestamp: float = 0.0
    # when each id is used: the sorted distinct ids, each one's place in its chain, and the
    # request indices using ids[k] (ascending) at uses[starts[k]:starts[k + 1]]
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    depth: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    uses: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def ceiling(self) -> float:
        return self.ceiling_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def next_use(self, hash_id: int, now: int) -> tuple[int | None, int]:
        """The first request index >= `now` whose prompt holds `hash_id` (None: none does), and
        the id's depth in its chain."""
        k = int(np.searchsorted(self.ids, hash_id))
        if k == len(self.ids) or self.ids[k] != hash_id:
            return None, 0
        s, e = int(self.starts[k]), int(self.starts[k + 1])
        j = bisect.bisect_left(self.uses, now, s, e)
        return (int(self.uses[j]) if j < e else None), int(self.depth[k])


def scan(path: Path | str, block_size: int = TRACE_BLOCK, limit: int | None = None) -> TraceIndex:
    """Read and check the first `limit` requests of a trace (None: all) once; raises TraceError
    for a bad line or a block size that does not divide 512, before anything has run."""
    check_block_size(block_size, path)
    ix = TraceIndex(path=str(path), block_size=block_size)
    bs, per = block_size, TRACE_BLOCK // block_size
    cover: dict[int, int] = {}  # id -> tokens of its block an earlier prompt held
    all_ids: list[np.ndarray] = []
    all_req: list[np.ndarray] = []
    depth: dict[int, int] = {}
    for i, r in enumerate(read_trace(path, limit)):
        L, ids = r.input_length, r.hash_ids
        if i == 0:
            ix.first_timestamp = r.timestamp
        ix.last_timestamp = r.timestamp
        ix.requests += 1
        ix.prompt_tokens += L
        ix.output_tokens += r.output_length
        need = -(-(L + r.output_length) // bs)
        ix.blocks_needed += need
        ix.largest_request = max(ix.largest_request, need)
        hit = 0
        for h in ids:
            c = cover.get(h)
            if c is None:
                break
            k = c // bs
            hit += min(k, per)
            if k < per:
                break
        ix.ceiling_hit_tokens += min(hit, (L - 1) // bs) * bs
        for t, h in enumerate(ids):
            c = min(TRACE_BLOCK, L - t * TRACE_BLOCK)
            if cover.get(h, 0) < c:
                cover[h] = c
            depth.setdefault(h, t)
        all_ids.append(np.asarray(ids, np.int64))
        all_req.append(np.full(len(ids), i, np.int32))
    flat = np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64)
    req = np.concatenate(all_req) if all_req else np.zeros(0, np.int32)
    order = np.lexsort((req, flat))  # by id, then request
    ix.ids, counts = np.unique(flat, return_counts=True)
    ix.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ix.uses = req[order]
    ix.depth = np.fromiter((depth[int(h)] for h in ix.ids), np.int32, len(ix.ids))
    return ix
