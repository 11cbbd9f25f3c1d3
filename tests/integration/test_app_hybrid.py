"""The dashboard on a hybrid model under AppTest: a real engine serving tiny-gemma3 (Gemma 3's
architecture, small: two sliding-window layers of 32 tokens and one full-attention layer, so three
KV-cache groups), the lesson on sliding windows run from Start to its end with Next alone (every
caption's claims checked against the pool), and the views' hybrid parts while it runs: a
block-table row per group, the header's groups, what the windows save, the prefix tree's blocks
per group."""
from __future__ import annotations

import re

import pytest

from kvscope_contract import protocol as p
from kvscope_contract.kv_groups import group_layers
from app.link.launcher import ServerProcess
from tests.apptest import LESSONS, html_with, panels, rerun_until, walk_lesson

HYBRID = [k for k, lesson in LESSONS.items() if lesson.model]


@pytest.fixture(scope="module")
def engine():
    """tiny-gemma3 with its KV-cache groups (the engine derives them from the model's layers; the
    pool names them too, so that this holds on an engine that does not yet)."""
    from engine.model.model_loader import TINY_GEMMA3_WINDOW
    pool = p.PoolConfig(kv_groups=group_layers([TINY_GEMMA3_WINDOW, TINY_GEMMA3_WINDOW, None]))
    proc = ServerProcess("engine.serve.server", ["--model", "tiny-gemma3", "--port", "0",
                                                 "--pool", p.encode(pool).decode()]).start()
    assert proc.wait_ready(120), "\n".join(proc.tail(30))
    yield proc
    proc.stop()


def test_the_lesson_on_sliding_windows_is_a_lesson_of_its_own():
    assert HYBRID == ["09_sliding_windows"] and LESSONS[HYBRID[0]].model == "gemma3"


@pytest.mark.parametrize("key", HYBRID)
def test_the_hybrid_lesson_runs_to_its_end_with_next_alone(at, observer, key):
    walk_lesson(at, observer, key)
    groups = observer.view().mirror.config.groups
    assert [g.kind for g in groups] == ["sliding_window", "sliding_window", "full_attention"]
    tables = html_with(at, 'class="bt"')
    labels = [x.replace("<br>", " · ") for x in re.findall(r'<span class="gl" title="[^"]*">(.+?)</span>', tables)]
    assert "groups 0, 1 · sliding 32 ×2" in labels or "group 0 · sliding 32" in labels, labels
    assert "group 2 · full" in labels and 'class="ch null"' in tables  # the windows' empty entries
    assert "KV-cache groups · <b>sliding 32 ×2</b> (groups 0, 1)" in panels(at)["metrics"]["groups"]
    card = html_with(at, "What paging saves")
    assert "Full attention on every layer would hold" in card and "they save" in card
    next(c for c in at.segmented_control if c.label == "History").set_value("Prefix tree").run()
    tree = rerun_until(at, lambda a: next((h.value for h in a.html if 'class="pt"' in h.value), None), what="the tree")
    assert "physical blocks in 3 KV-cache groups" in tree and "blocks by KV-cache group: group 0:" in tree
    at.session_state["bt_controls"] = {**at.session_state["bt_controls"], "groups": True}  # as its checkbox does
    at.run()
    tables = html_with(at, 'class="bt"')
    assert {"group 0 · sliding 32", "group 1 · sliding 32", "group 2 · full"} <= {
        x.replace("<br>", " · ") for x in re.findall(r'<span class="gl" title="[^"]*">(.+?)</span>', tables)}
