"""Helpers of the trace tests: where the Mooncake traces are, small traces of one's own, and the
reuse ceiling computed straight from the hash ids (independently of engine/lab/trace.py)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the main checkout's sibling folder (a worktree's is one level further up)
MOONCAKE = next((p for p in (ROOT.parent / "shared/traces/mooncake", ROOT.parents[1] / "shared/traces/mooncake")
                 if p.is_dir()), ROOT.parent / "shared/traces/mooncake")


def mooncake(name: str) -> Path:
    """A Mooncake trace (conversation, synthetic), or skip the test saying where it was looked for."""
    path = MOONCAKE / f"{name}_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"the Mooncake traces are not at {MOONCAKE} (see its README.md)")
    return path


def write(tmp_path: Path, rows: list, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def req(t: float, ids: list[int], length: int | None = None, out: int = 4) -> dict:
    return {"timestamp": t, "input_length": length or 512 * len(ids), "output_length": out, "hash_ids": ids}


def ceiling_512(path: Path, limit: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of the exact reuse ceiling at 512-token blocks: per request,
    its leading ids that an earlier prompt held as a full block, never the block of its last
    token."""
    full: set[int] = set()
    hit = total = 0
    with open(path) as f:
        for n, line in enumerate(f):
            if n == limit:
                break
            r = json.loads(line)
            ids, length = r["hash_ids"], r["input_length"]
            k = 0
            while k < len(ids) and ids[k] in full:
                k += 1
            hit += 512 * min(k, (length - 1) // 512)
            total += length
            full.update(ids[:length // 512])
    return hit, total


def write_trace(path: Path, requests: int, seed: int = 35) -> None:
    """Five system prompts of 2-4 blocks, forty conversations each on one of them, every request a
    turn of one (a few busy ones, many quiet) adding a block or two to its chain; arrivals 0-400 ms apart."""
    rng = random.Random(seed)
    fresh = iter(range(10 ** 9))
    systems = [[next(fresh) for _ in range(rng.randint(2, 4))] for _ in range(5)]
    chats = [list(rng.choice(systems)) for _ in range(40)]
    t = 0
    with open(path, "w") as f:
        for _ in range(requests):
            chat = chats[min(int(rng.expovariate(1 / 8)), len(chats) - 1)]
            chat.extend(next(fresh) for _ in range(rng.randint(1, 2)))
            f.write(json.dumps({"timestamp": t, "input_length": (len(chat) - 1) * 512 + rng.randint(1, 512),
                                "output_length": rng.randint(16, 256), "hash_ids": chat}) + "\n")
            t += rng.randint(0, 400)
