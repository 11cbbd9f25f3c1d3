"""Where the event history keeps its events: packed, a million of them in a few dozen MB.

As Python objects an event takes a few hundred bytes; packed with msgpack in chunks of
CHUNK it takes about 60. The newest chunk stays as objects (every live view reads it); older
chunks are bytes, decoded when time travel or the event log reach them, the few most
recently used kept decoded. It reads like a list (index, slice, len, delete from the front)
plus `bisect_left` by event number; an event's prompt token texts are dropped on the way in
(the mirror's text store has read them; they would be most of the bytes).
"""
from __future__ import annotations

import bisect
from collections import OrderedDict

import msgspec
import numpy as np

from kvscope_contract import protocol as p

CHUNK = 4096
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[p.AnyEvent])


class EventStore:
    def __init__(self, keep_decoded: int = 16):
        self.packed: list[bytes] = []        # full chunks, oldest first
        self.numbers: list[np.ndarray] = []  # each packed chunk's event numbers
        self.firsts: list[int] = []          # each packed chunk's first event number
        self.hot: list[p.AnyEvent] = []      # the newest chunk, as objects
        self.start = 0                       # events of the first chunk already deleted
        self.decoded: OrderedDict[int, list] = OrderedDict()  # by absolute chunk number
        self.first_chunk = 0                 # absolute number of packed[0]
        self.keep_decoded = keep_decoded

    # ------------------------------------------------------------------ writing
    def append(self, ev: p.AnyEvent) -> None:
        if isinstance(ev, p.RequestAdded):
            ev.prompt_token_texts = None
        self.hot.append(ev)
        if len(self.hot) == CHUNK:
            self.packed.append(_encoder.encode(self.hot))
            self.numbers.append(np.fromiter((e.seq for e in self.hot), np.int64, CHUNK))
            self.firsts.append(int(self.numbers[-1][0]))
            self.decoded[self.first_chunk + len(self.packed) - 1] = self.hot
            self._trim_decoded()
            self.hot = []

    def __delitem__(self, key: slice) -> None:
        """Only `del store[:k]`: drop the k oldest events."""
        if not isinstance(key, slice) or key.start not in (None, 0) or key.step not in (None, 1):
            raise TypeError("an EventStore only drops its oldest events: del store[:k]")
        k = min(len(self), max(0, key.stop if key.stop is not None else len(self)))
        k += self.start
        while self.packed and k >= CHUNK:
            self.packed.pop(0)
            self.numbers.pop(0)
            self.firsts.pop(0)
            self.decoded.pop(self.first_chunk, None)
            self.first_chunk += 1
            k -= CHUNK
        if not self.packed:
            del self.hot[:k]
            k = 0
        self.start = k

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.packed) * CHUNK + len(self.hot) - self.start

    def _chunk(self, c: int) -> list[p.AnyEvent]:
        """Packed chunk c (relative), decoded."""
        key = self.first_chunk + c
        events = self.decoded.get(key)
        if events is None:
            events = self.decoded[key] = _decoder.decode(self.packed[c])
            self._trim_decoded()
        self.decoded.move_to_end(key)
        return events

    def _trim_decoded(self) -> None:
        while len(self.decoded) > self.keep_decoded:
            self.decoded.popitem(last=False)

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            lo, hi, step = key.indices(n)
            if step != 1:
                return [self[i] for i in range(lo, hi, step)]
            out: list[p.AnyEvent] = []
            i = lo
            while i < hi:
                j = i + self.start
                c, off = divmod(j, CHUNK)
                if c < len(self.packed):
                    take = min(hi - i, CHUNK - off)
                    out += self._chunk(c)[off:off + take]
                else:
                    take = hi - i
                    out += self.hot[off:off + take]
                i += take
            return out
        if key < 0:
            key += n
        if not 0 <= key < n:
            raise IndexError("event index out of range")
        c, off = divmod(key + self.start, CHUNK)
        return self._chunk(c)[off] if c < len(self.packed) else self.hot[off]

    def __iter__(self):
        for c in range(len(self.packed)):
            yield from self._chunk(c)[self.start if c == 0 else 0:]
        yield from self.hot[self.start if not self.packed else 0:]

    def bisect_left(self, seq: int) -> int:
        """Index of the first retained event numbered >= seq (numbers rise, with gaps)."""
        c = bisect.bisect_right(self.firsts, seq) - 1
        if c >= 0:
            i = c * CHUNK + int(np.searchsorted(self.numbers[c], seq))
            if i < (c + 1) * CHUNK or c + 1 < len(self.numbers):
                return max(0, i - self.start)
        base = len(self.packed) * CHUNK
        if c < 0 and self.packed:
            return 0
        return max(0, base + bisect.bisect_left(self.hot, seq, key=lambda e: e.seq) - self.start)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed chunks and their numbers (the objects not counted)."""
        return sum(map(len, self.packed)) + sum(a.nbytes for a in self.numbers)
