"""The hub's admission (engine/serve/admission.py): a burst at once, then turns at a rate, and
no turn further off than its longest wait."""
from __future__ import annotations

import asyncio
import time

from engine.serve.admission import Admission


def test_a_burst_gets_in_at_once_the_next_waits_its_turn_and_one_too_far_off_is_refused():
    async def storm() -> tuple[list[bool], float, bool]:
        admission = Admission(rate=1.0, burst=2, max_wait_s=1.5)
        start = time.monotonic()
        # four at once: two from the burst, one a second later, one whose turn (2 s) is too far off
        admitted = await asyncio.gather(*(admission.admit() for _ in range(4)))
        took = time.monotonic() - start
        # the refused one took no turn: the next is one second off again, not two
        return admitted, took, await admission.admit()

    admitted, took, after = asyncio.run(storm())
    assert admitted == [True, True, True, False]
    assert took >= 0.95  # the third waited for its token
    assert after
