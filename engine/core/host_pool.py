"""The host pool: the CPU blocks swapped-out sequences keep their K/V in.

A sequence swapped out while a sibling of its fork group stays on the device leaves the device
block and its host copy holding the same K/V: the pair is remembered for as long as both are
held, so the sibling's own swap joins the host copy instead of copying the block again (and a
swap-in joins a device block still held). A host block copied from a block of the prefix cache
remembers that block's content (group, hash, tokens), so a swap-in can find it in the cache.
"""
from __future__ import annotations

from collections import deque


class HostPool:
    """Host blocks: free FIFO, ref counts, and the device blocks they still mirror.

    Promises, after every public method returns:
    - `ref_counts[h]` is the number of host-table entries of swapped sequences naming h; a
      host block with none is in `free` and mirrors nothing.
    - `host_copy[d] == h` exactly when `device_copy[h] == d`: both hold the same K/V and both
      are held; writing d in place or freeing either ends the pair.
    """

    def __init__(self, num_blocks: int):
        self.free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.host_copy: dict[int, int] = {}    # device -> host
        self.device_copy: dict[int, int] = {}  # host -> device
        self.content: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # host -> (group, hash, tokens)

    def take(self) -> int:
        """A free host block, no holder yet (`hold` counts them)."""
        return self.free.popleft()

    def hold(self, h: int, n: int) -> None:
        """`n` more holders of h (the sequences of a swap that name it)."""
        self.ref_counts[h] += n

    def release(self, h: int) -> None:
        """One holder of h less; at none it is free again and its pair, if any, ends."""
        self.ref_counts[h] -= 1
        if not self.ref_counts[h]:
            self.free.append(h)
            self.content.pop(h, None)
            if (d := self.device_copy.pop(h, None)) is not None:
                del self.host_copy[d]

    def pair(self, d: int, h: int) -> None:
        """Device block d and host block h hold the same K/V (for as long as both are held)."""
        self.host_copy[d], self.device_copy[h] = h, d

    def unpair_device(self, d: int) -> None:
        """Device block d is freed or written in place: its host copy no longer mirrors it."""
        if (h := self.host_copy.pop(d, None)) is not None:
            del self.device_copy[h]
