"""The "why not more?" panel under AppTest against a real engine server (tiny model): opened from
the hit-rate chip, its numbers are the header's and an independent explainer's over the events an
observer received, each missed token has one reason, and the lab's replay of the session says what
would have hit (issue 26)."""
from __future__ import annotations

from kvscope_contract.misses import ExplainedPool, totals_of
from app.panels.misses import LABELS, PANEL
from tests.apptest import events, grid_data, metric_card, rerun_until
from tests.waiting import wait


def panel_text(at) -> str:
    return "\n".join(m.value for m in at.markdown)


def fold(c) -> ExplainedPool:
    """An explainer of the observer's own, over every event it received."""
    with c.lock:
        h = c.history
        first = h.first_event
        pool = ExplainedPool.from_state(h.at(first).state)
        evs = [e for e in h.events if e.seq > first]
    for ev in evs:
        pool.apply(ev)
    return pool


def test_the_hit_rate_chip_opens_why_not_more_with_the_headers_numbers_and_what_would_have_hit(at, observer):
    since = observer.history.last_event
    at.toggle(key="scenario_clean").set_value(True)
    at.button(key="scenario_shared").click().run()
    wait(lambda: len(events(observer, "finish", since)) >= 4 and not observer.view().mirror.state.seqs, 120,
         "the shared system prompt's requests to finish")
    assert metric_card(at, "Prefix hit rate")["button"][0] == PANEL  # the chip's button: as its trigger opens it
    at.session_state["panel_shown"] = PANEL
    at.session_state["log_version"] = (at.session_state["log_version"] if "log_version" in at.session_state else 0) + 1
    at.run()
    assert next(c for c in at.segmented_control if c.label == "History").value == PANEL
    last = observer.history.last_event
    text = rerun_until(at, lambda a: grid_data(a)["seq"] == last and "tokens looked up hit" in panel_text(a)
                       and panel_text(a), what="the panel")
    tl = observer.view().mirror.tally
    assert f"{tl.hit_tokens:,} of {tl.looked_up_tokens:,} tokens looked up hit" in text, text
    seg = observer.history.segment_start(last + 1)
    mine = totals_of([a for a in fold(observer).explainer.admissions if seg < a.event <= last])
    assert (mine.hit, mine.looked_up) == (tl.hit_tokens, tl.looked_up_tokens) and mine.hit > 0
    assert sum(mine.by_reason.values()) == mine.missed > 0
    for reason, n in mine.by_reason.items():
        assert f"**{LABELS[reason]}** {n:,}" in text, (reason, text)
    requests = next(d.value for d in at.dataframe if "why" in d.value.columns)
    assert set(requests["request"]) <= {e.request_id for e in events(observer, "request_added", since)}
    assert (requests["looked up"] - requests["hit"] == requests["missed"]).all()
    # the lab's replay of this session, in the background
    text = rerun_until(at, lambda a: "tokens with 2× blocks" in panel_text(a) and panel_text(a), 120,
                       "the what-if replay")
    assert "A replay of this session's" in "\n".join(c.value for c in at.caption)
