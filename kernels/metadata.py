"""Attention metadata: built once per engine step from the scheduler's lists, read by all layers.

Besides the tensors the Triton kernel reads, it plans (on first use, so CUDA steps never pay for
it) what the torch path needs so that each layer does only gathers and SDPA calls: the decode
rows sorted by length and cut into batches of about DECODE_CHUNK_TOKENS context tokens, each
padded only to its own longest, and per prefill chunk its rows, block ids and causal mask; and
for the C++ CPU kernel, the decode rows with their block tables (`decode_rows`).

A sliding window (`window` W > 0, the layers of a sliding-window KV group) limits the query at
position p to keys p - W + 1 .. p: the torch path gathers only the blocks holding those keys and
masks the rest, the kernels start their walk there. Blocks wholly before a window may have left
the table (NULL_BLOCK, -1): they are mapped to block 0 here, and no kernel reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

# Context tokens gathered per decode SDPA call: small enough that the gathered K/V (6 MB for
# SmolLM2 in fp32) is still in cache when SDPA reads it. 32 x 512 tokens, shuffled block tables,
# per layer against contiguous SDPA on the 2-core bench machine: one call 1.7x, 2,048-token
# batches 1.5x, 4,096 1.42x, 8,192 1.45x.
DECODE_CHUNK_TOKENS = 4096


@dataclass
class DecodeBatch:
    rows: Tensor | slice       # query rows of these sequences (a slice when contiguous)
    num_seqs: int
    blocks: Tensor             # [num_seqs * nblk] int64 block ids, each sequence padded with block 0
    seq_len: int               # gathered context length: the longest of the batch
    mask: Tensor | None        # [n, 1, 1, seq_len] additive (0 / -inf); None: no padding


@dataclass
class PrefillChunk:
    start: int                 # first query row of the chunk in the flat batch
    end: int
    blocks: Tensor             # int64 physical block ids of the keys first..seq_len-1
    seq_len: int               # context length after this step (cached prefix + chunk)
    mask: Tensor | None        # [q_len, seq_len - first] additive (0 / -inf); None: plain causal (no prefix)
    first: int = 0             # the first key gathered (block-aligned; > 0 only under a sliding window)


@dataclass
class DecodeRows:
    """The decode rows as the C++ kernel reads them (no sorting, no padding, no gather)."""
    rows: Tensor               # [n] int64 query rows
    block_tables: Tensor       # [n, max_blocks] int32
    seq_lens: Tensor           # [n] int32


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor       # [T] int64, slot of each new token; -1 = do not store
    query_start_loc: Tensor    # [B+1] int32
    seq_lens: Tensor           # [B] int32, context length after this step
    block_tables: Tensor       # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    host: tuple = field(repr=False)  # (query_lens, seq_lens, query starts, CPU block table): the plan's input
    window: int = 0            # a sliding window of this many tokens (0: full causal attention)
    _cast: dict = field(default_factory=dict, repr=False)

    @cached_property
    def fresh_prefills(self) -> tuple[Tensor | None, list]:
        """(spans [n, 2] int64 of the prefill chunks with no cached prefix, or None; the other
        chunks): the first go to the C++ prefill kernel, which reads the step's new K/V rows."""
        fresh = [p for p in self.prefills if p.end - p.start == p.seq_len]
        spans = torch.tensor([(p.start, p.end) for p in fresh], dtype=torch.int64) if fresh else None
        return spans, [p for p in self.prefills if p.end - p.start != p.seq_len]

    @cached_property
    def decode_rows(self) -> DecodeRows | None:
        """Rows with one query token; an all-decode batch reuses the step's tensors as they are."""
        query_lens, _, starts, _ = self.host
        idx = [i for i, q in enumerate(query_lens) if q == 1]
        if not idx:
            return None
        rows = torch.tensor([starts[i] for i in idx], dtype=torch.int64, device=self.slot_mapping.device)
        if len(idx) == len(query_lens):
            return DecodeRows(rows, self.block_tables, self.seq_lens)
        sel = torch.tensor(idx, device=self.slot_mapping.device)
        return DecodeRows(rows, self.block_tables[sel], self.seq_lens[sel])

    def _first_key(self, pos: int) -> int:
        """The first key a query at position `pos` attends to."""
        return max(0, pos - self.window + 1) if self.window else 0

    @cached_property
    def decodes(self) -> list[DecodeBatch]:
        """Decode rows (q_len 1), sorted by gathered length so that similar lengths share a batch;
        each gathers its blocks from the first one its window reaches."""
        query_lens, seq_lens, starts, table = self.host
        dev, bs, out = self.slot_mapping.device, self.block_size, []
        skip = {i: self._first_key(seq_lens[i] - 1) // bs for i, q in enumerate(query_lens) if q == 1}  # blocks
        length = {i: seq_lens[i] - b * bs for i, b in skip.items()}  # keys gathered
        todo = sorted(skip, key=length.get)
        while todo:
            n = 1
            while n < len(todo) and (n + 1) * length[todo[n]] <= DECODE_CHUNK_TOKENS:
                n += 1
            batch, todo = todo[:n], todo[n:]
            rows, lens = [starts[i] for i in batch], torch.tensor([length[i] for i in batch])
            L, nblk = int(lens[-1]), -(-int(lens[-1]) // bs)
            if self.window:  # each row from its own first block, keys before the window masked
                firsts = torch.tensor([self._first_key(seq_lens[i] - 1) - skip[i] * bs for i in batch])
                keys = torch.arange(L)
                allowed = (keys < lens[:, None]) & (keys >= firsts[:, None])
                mask = None if bool(allowed.all()) else _additive(allowed).view(n, 1, 1, L).to(dev)
                blocks = torch.stack([_padded(table[i, skip[i]:skip[i] + nblk], nblk) for i in batch])
            else:
                mask = None if lens[0] == L else _additive(torch.arange(L) < lens[:, None]).view(n, 1, 1, L).to(dev)
                blocks = table[batch, :nblk]
            contiguous = all(b - a == 1 for a, b in zip(rows, rows[1:]))
            out.append(DecodeBatch(slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=dev), n,
                                   blocks.flatten().long().to(dev), L, mask))
        return out

    @cached_property
    def prefills(self) -> list[PrefillChunk]:
        query_lens, seq_lens, starts, table = self.host
        dev, bs, out = self.slot_mapping.device, self.block_size, []
        for i, (q, L) in enumerate(zip(query_lens, seq_lens)):
            if q > 1:  # new token j sits at position L - q + j and sees keys 0..L - q + j (or its window)
                first = self._first_key(L - q) // bs * bs
                pos, keys = torch.arange(L - q, L)[:, None], torch.arange(first, L)
                allowed = (keys <= pos) & (keys >= pos - self.window + 1 if self.window else True)
                plain = q == L and bool(allowed.equal(keys <= pos))  # no prefix, no window cut: is_causal
                out.append(PrefillChunk(starts[i], starts[i + 1], table[i, first // bs:-(-L // bs)].long().to(dev),
                                        L, None if plain else _additive(allowed).to(dev), first))
        return out

    def cast(self, mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        """SDPA wants float masks in the query dtype: convert once per step, not once per layer."""
        if mask is None or mask.dtype == dtype:
            return mask
        return self._cast.setdefault((id(mask), dtype), mask.to(dtype))


def _additive(allowed: Tensor) -> Tensor:
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def _padded(blocks: Tensor, n: int) -> Tensor:
    """`blocks` (of one table row) padded with block 0 to n entries."""
    return torch.cat([blocks, blocks.new_zeros(n - len(blocks))]) if len(blocks) < n else blocks


def build_attention_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                             slot_mapping: list[int], block_size: int, device, window: int | None = None
                             ) -> AttentionMetadata:
    """window: the layers' sliding window in tokens (None or 0: full causal attention)."""
    B = len(query_lens)
    nblks = [-(-s // block_size) for s in seq_lens]
    width = max(nblks, default=1)
    table = torch.tensor([t[:n] + [0] * (width - n) for t, n in zip(block_tables, nblks)],
                         dtype=torch.int32).view(B, width)  # view: B == 0 gives [0, width]
    if window:
        table.clamp_(min=0)  # NULL_BLOCK entries (before every window): block 0, never read
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device), max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0), block_size=block_size, host=(query_lens, seq_lens, starts, table),
        window=window or 0)
