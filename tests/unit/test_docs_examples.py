"""The Python a reader copies from the docs runs as written: the README's block manager in a few
lines, and docs/traces.md's own eviction policy plugged into a trace replay."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from engine.lab.trace import scan
from engine.lab.trace_sweep import replay
from tests.traces import req, write

ROOT = Path(__file__).resolve().parents[2]


def python_after(doc: str, heading: str) -> str:
    """The first ```python block after `heading` in `doc`."""
    text = (ROOT / doc).read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_the_readmes_block_manager_example_runs_and_emits_what_it_says():
    scope: dict = {}
    exec(python_after("README.md", "## The block manager in a few lines"), scope)
    kinds = Counter(type(ev).__name__ for ev in scope["events"])
    assert kinds["Alloc"] and kinds["Fork"] == 1 and kinds["SwapOut"] == kinds["SwapIn"] == 1
    assert kinds["Reset"] == 1
    tables, seq = scope["seq"].block_tables, scope["seq"]  # the hybrid part: a table per group, windows passed
    assert len(tables) == len(scope["bm"].groups) > 1 and len(seq) == 1000
    assert [-1 in t for t in tables] == [g.kind == "sliding_window" for g in scope["bm"].groups]
    assert any(type(ev).__name__ == "WindowFree" for ev in scope["log"].drain())


def test_the_policy_of_ones_own_in_the_traces_doc_plugs_into_a_replay(tmp_path, monkeypatch):
    (tmp_path / "mypolicies.py").write_text(python_after("docs/traces.md", "**Your own policy**"))
    monkeypatch.syspath_prepend(str(tmp_path))
    # a shared two-block prefix, then others that push it out of a small pool, then it again
    rows = [req(0, [0, 1, 2]), req(1, [10, 11, 12]), req(2, [20, 21, 22]), req(3, [0, 1, 3])]
    index = scan(write(tmp_path, rows), 512, None)
    mru, lru = (replay(index, 7, policy, one_at_a_time=True) for policy in ("mypolicies:MRU", "lru"))
    assert mru.policy == "MRU" and mru.evictions > 0
    assert mru.hit_tokens > lru.hit_tokens == 0  # LRU evicted the oldest chain; MRU the newest
