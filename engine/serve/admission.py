"""How fast a hub lets new connections in: a burst at once, then a steady rate.

Every connection costs the process that serves it a handshake, a hello and a snapshot. Inside
vLLM's engine core that is time taken from vLLM's steps, so a dashboard reconnecting in a loop
would slow vLLM down however cheap each connection is. Past the burst, a new connection's
handshake waits its turn on the loop (asleep: it costs nothing), so a reconnect loop slows down
to `rate` connections a second; a room of dashboards opening at once fits in the burst. A turn
further off than `max_wait_s` is not given: the connection is refused at once (a client would
give up waiting for it, and its turn would be lost to everyone behind it), to try again later.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class Admission:
    """A token bucket of `burst` tokens refilled at `rate` a second; `admit` takes one, waiting
    for it (in the order asked) when the bucket is empty, or takes none and says False when that
    wait would be longer than `max_wait_s`."""
    rate: float
    burst: int
    max_wait_s: float = 3.0  # below the dashboard's handshake timeout (5 s) and websockets' (10 s)
    _tokens: float = field(init=False)
    _at: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._tokens = float(self.burst)

    async def admit(self) -> bool:
        now = time.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        wait = (1 - self._tokens) / self.rate  # until a whole token is there (<= 0: it is)
        if wait > self.max_wait_s:
            return False
        self._tokens -= 1
        if wait > 0:  # a token taken ahead of its refill: wait until it would have come
            await asyncio.sleep(wait)
        return True
