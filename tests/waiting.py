"""Small helpers the app and browser tests share."""
from __future__ import annotations

import time
from kvscope_contract.ready import free_port


def wait(cond, timeout: float = 20.0, what: str = "condition"):
    """Poll `cond` until it returns something true; that value, or an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := cond():
            return out
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


