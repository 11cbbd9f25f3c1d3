"""What assets/grid.js does with a message from app/panels/grid.py, for tests that check the
canvas keeps up (tests/unit/test_views_agree.py, tests/unit/test_lane.py)."""
from __future__ import annotations

from app.panels import grid


def canvas(held: dict, data: bytes) -> tuple[dict, bool]:
    """What assets/grid.js does with a message: (the columns it then holds, whether it applied
    the message; a delta from a frame it does not hold is dropped)."""
    head, parts = grid.read(data)
    if head["kind"] == "full":
        return {"token": head["token"], "dev": parts["dev"].copy(), "host": parts["host"].copy(),
                "seqs": {k: v for k, *v in head["seqs"]}, "panels": head.get("panels", {}),
                "msg": head.get("msg")}, True
    if held.get("token") not in head.get("bases", [head["base"]]):
        return held, False
    dev, host = held["dev"].copy(), held["host"].copy()
    if "devIdx" in parts:
        dev[parts["devIdx"]] = parts["dev"]
        host[parts["hostIdx"]] = parts["host"]
    seqs = {k: v for k, v in held["seqs"].items() if k not in head["gone"]} | {k: v for k, *v in head["seqs"]}
    panels = {**held.get("panels", {}), **head.get("panels", {})}  # a panel left out: unchanged
    return {"token": head["token"], "dev": dev, "host": host, "seqs": seqs, "panels": panels,
            "msg": head.get("msg")}, True
