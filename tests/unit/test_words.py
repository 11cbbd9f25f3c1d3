"""Item 13 of issue 17: counts said in words by one rule, no fractional step ticks, and the
card that compares reservation with paging says what it shows when paging holds more."""
from __future__ import annotations

import re

import msgspec.inspect as mi

from kvscope_contract import protocol as p
from kvscope_contract.kinds import kind_of, words
from app.panels import header, tables, timeline
from app.link.client import View
from app.history.event_history import EventHistory
from app.derived.words import count, plural, rate
from tests.pool_driver import PoolDriver


def test_one_rule_for_plurals():
    assert plural(1, "block") == "1 block" and plural(2, "block") == "2 blocks"
    assert plural(0, "slot") == "0 slots" and plural(1_048_576, "block") == "1,048,576 blocks"
    assert plural(1, "prefix", "prefixes") == "1 prefix" and plural(3, "prefix", "prefixes") == "3 prefixes"


def test_a_rate_fits_a_metric_card():
    """Walk of issue 17: tens of thousands of tokens/s read "80,13…" on a 1M-block pool."""
    assert rate(0) == "0.0" and rate(97.64) == "97.6" and rate(999.94) == "999.9"
    assert rate(999.96) == "1.0 k" and rate(3353.2) == "3.4 k" and rate(80_135.2) == "80.1 k"
    assert rate(801_234) == "801 k" and rate(2_500_000) == "2.5 M"
    assert all(len(rate(x)) <= 6 for x in (0, 5.25, 999.94, 999.96, 12_345.6, 999_940, 1e6, 9.9e6))


def test_a_count_fits_a_metric_chip():
    """Walk of issue 17: the hit rate's chip read "91,296 / 364,810 …" on a 1M-block pool."""
    from app.panels.header import _of_tokens
    assert count(0) == "0" and count(9_999) == "9,999" and count(10_000) == "10 k" and count(41_776) == "41.8 k"
    assert count(364_810) == "365 k" and count(999_499) == "999 k" and count(999_500) == "1 M"
    assert count(1_048_576) == "1.05 M" and count(12_345_678) == "12.3 M"
    assert _of_tokens(288, 474) == "288 / 474 tokens" and _of_tokens(0, 9_999) == "0 / 9,999 tokens"
    assert _of_tokens(224, 4_889) == "224 / 4,889"
    assert _of_tokens(91_296, 364_810) == "91.3 k / 365 k"
    assert all(len(_of_tokens(a, b)) <= 16 for a, b in ((9_999, 9_999), (41_776, 180_001), (999_999, 12_345_678)))


def test_what_paging_saves_says_when_paging_holds_more():
    """Block size 64, short sequences: paging holds more slots than the reservation; the card
    says so (the lesson) instead of dropping its summary line."""
    cfg = p.PoolConfig(block_size=64, num_device_blocks=8, bytes_per_block=64 * 1024)
    more = header.summary(205, 256, cfg)
    assert "Paging holds <b>51 more slots</b>" in more and "internal fragmentation" in more
    assert "<b>1 fewer slot</b>" in header.summary(257, 256, cfg)
    assert header.summary(0, 0, cfg) == ""


def test_a_one_block_sequence_is_said_in_the_singular():
    d = PoolDriver(p.PoolConfig(block_size=16, num_device_blocks=8, num_host_blocks=0))
    h = EventHistory(d.first)
    d.admit(d.add(list(range(10))))
    for ev in d.drain():
        h.append(ev)
    html = tables.render(View(h.at(h.last_event), True, 1, []), {})
    assert "· 1 block<" in html and not re.search(r"\b1 blocks\b", html)


def test_step_ticks_are_whole_numbers():
    for spec in (timeline.blocks_chart([], [], None, 8), timeline.rates_chart([], None)):
        axes = [layer["encoding"]["x"].get("axis", {}) for layer in spec["layer"] if "x" in layer.get("encoding", {})]
        area = axes[0]
        assert area.get("format") == "d" and area.get("tickMinStep") == 1, axes


def test_timeline_charts_hold_no_empty_layer():
    """Walk of issue 29: an empty layer (no markers, no cursor while live) made Vega warn "Infinite
    extent for field step" at every redraw; such layers are left out, the rest kept."""
    from app.history.event_history import Marker, StepPoint
    import dataclasses

    points = [StepPoint(**{f.name: (i if f.name == "step" else 0) for f in dataclasses.fields(StepPoint)})
              for i in range(1, 4)]
    for spec in (timeline.blocks_chart(points, [], None, 8), timeline.rates_chart(points, None)):
        named = [layer["data"]["name"] for layer in spec["layer"]]
        assert "cursor" not in named and "markers" not in named and all(spec["datasets"][n] for n in named), named
    marker = Marker(**{f.name: ("preempt" if f.name == "kind" else "s1" if f.name == "seq_id" else 2)
                       for f in dataclasses.fields(Marker)})
    spec = timeline.blocks_chart(points, [marker], 2, 8)
    assert [layer["data"]["name"] for layer in spec["layer"]] == ["blocks", "markers", "cursor"]


def test_lifetime_histograms_bin_whole_steps():
    """Walk of issue 17: seven reuse gaps of 152 steps (vLLM, Overload) drew one bar from 151.5 to
    152.5 under ticks 151.5, 151.7, ...: bins are whole steps, ticks too. Issue 28: reuse gaps of 0
    steps drew one bar across 0-1: each bar is labelled by the steps it counts ("0", "5–9")."""
    import numpy as np
    from app.panels.history_panels import _histogram
    for values in ([152] * 7, [0, 1, 1, 5], list(range(3, 250, 7)), [7, 1000]):
        spec = _histogram(np.array(values))
        bins = spec["data"]["values"]
        assert all(isinstance(b["from"], int) and isinstance(b["to"], int) for b in bins), bins
        assert len(bins) <= 20 and sum(b["blocks"] for b in bins) == len(values)
        assert bins[0]["from"] <= min(values) and max(values) < bins[-1]["to"]
        assert all(b["steps"] == (str(b["from"]) if b["to"] - b["from"] == 1 else f"{b['from']}–{b['to'] - 1}")
                   for b in bins), bins
        x = spec["encoding"]["x"]
        assert x["field"] == "steps" and x["type"] == "ordinal" and "x2" not in spec["encoding"]
    assert _histogram(np.array([152] * 7))["data"]["values"] == [{"from": 152, "to": 153, "steps": "152", "blocks": 7}]
    assert [b["steps"] for b in _histogram(np.array([0, 0, 0]))["data"]["values"]] == ["0"]


def test_big_numbers_carry_thousands_separators():
    from app.panels.eventlog import describe
    from app.panels.header import _short
    step = p.StepDone(num_running=251, num_waiting=1259, num_swapped=0, prefill_tokens=4096, decode_tokens=253,
                      duration_ms=3.3, free_blocks=2, cached_blocks=1_032_419)
    text = describe(step)[2]
    assert "1,032,419 cached" in text and "4,096 prefill" in text and "1,259 waiting" in text
    assert _short(1_048_576) == "1.05 M" and _short(65_536) == "65,536"


def _sample(t):
    """A value of the msgspec type `t`, for a field an event requires."""
    match t:
        case mi.IntType():
            return 3
        case mi.FloatType():
            return 1.5
        case mi.StrType():
            return "s1"
        case mi.LiteralType():
            return t.values[0]
        case mi.ListType():
            return [_sample(t.item_type)]
        case mi.TupleType():
            return tuple(_sample(x) for x in t.item_types)
        case mi.StructType():
            return t.cls()
    raise TypeError(t)


def test_every_event_kind_is_said_in_words():
    """The event log and the time-travel bar say each event (kvscope_contract.kinds.words): a new
    kind of the protocol needs its words there."""
    said = set()
    for cls in (c for c in vars(p).values() if isinstance(c, type) and issubclass(c, p.Event) and c is not p.Event):
        ev = cls(**{f.name: _sample(f.type) for f in mi.type_info(cls).fields if f.required})
        assert words(ev), f"{kind_of(ev)} has no words"
        said.add(kind_of(ev))
    assert said == set(p.EVENT_KINDS)


def test_every_count_in_the_metrics_has_its_thousands_separator():
    """Issue 28: "8,241 copies · 8790 forks"."""
    from app.link.client import Redraw, Status
    from tests.histories import busy_history, view_at
    h, _ = busy_history(seed=2, ops=200)
    view = view_at(h, h.last_event)
    tl = view.mirror.tally
    tl.cows, tl.forks, tl.preemptions, tl.recomputes, tl.finished = 8241, 8790, 12_345, 1234, 56_789
    r = Redraw(view, h.first_event, h.last_event, (), p.LoopState(paused=False, step_delay_ms=0.0), Status(), None,
               "ws://x", {})
    said = " ".join(f"{m['value']} {m['delta']} {m['help']}" for m in header.metrics(r)["cards"])
    assert "8,790 forks" in said and "1,234 recomputed" in said and "56,789 have finished" in said
    assert not re.findall(r"(?<![\d,.])\d{4,}(?![\d,])", said.replace("1.05 M", "")), said
