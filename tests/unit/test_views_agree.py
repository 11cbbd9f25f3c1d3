"""Every view of one redraw describes one state at one event (issue 17, item 7): the grid's
canvas keeps up with the views drawn beside it even when its acknowledgements lag, a block
table's chips say what the grid's hover says at every event (mid-step ones included), and the
timeline counts used blocks by the contract's one rule."""
from __future__ import annotations

import random
import re


from kvscope_contract import protocol as p
from app.panels import grid, tables
from app.history.event_history import EventHistory
from tests.grid_canvas import canvas
from tests.histories import busy_history, view_at


def outgoing(frame: grid.Frame, have, sent: list[int], frames: dict[int, grid.Frame]) -> bytes:
    """What grid.show sends for `frame` when the canvas last acknowledged `have`."""
    also = grid.unacknowledged(sent, have, frame.token)
    return grid.message(frame, frames.get(have), None, [frames[t] for t in also])


def test_the_canvas_keeps_up_while_its_acknowledgements_lag():
    """The server redraws (a heartbeat, a travel) before the canvas's acknowledgement of the
    last frame arrives: the next delta must still apply, or the grid's header shows an older
    step than the status line and the metrics drawn with it."""
    h, _ = busy_history(seed=3, ops=400)
    rng = random.Random(4)
    points = sorted(rng.sample(range(h.first_event, h.last_event + 1), 60))
    frames = [grid.build(view_at(h, n), {}) for n in points]
    by_token = {f.token: f for f in frames}
    sent: list[int] = []
    held, _ = canvas({}, outgoing(frames[0], None, sent, by_token))
    acked = frames[0].token
    for i, frame in enumerate(frames[1:], 1):
        held, applied = canvas(held, outgoing(frame, acked, sent, by_token))
        assert applied and held["token"] == frame.token, f"frame {i} dropped: the grid stays at an older event"
        assert held["dev"].tobytes() == frame.dev.records().tobytes()
        assert held["host"].tobytes() == frame.host.records().tobytes()
        assert held["seqs"] == frame.seqs
        if rng.random() < 0.3:  # now and then the acknowledgement arrives, of a frame some redraws old
            acked = frames[max(0, i - rng.randrange(0, 4))].token


def test_the_live_views_a_frame_leaves_out_are_those_the_browser_holds():
    """A frame carries only the live views that changed since a message the browser may hold; the
    browser, acknowledging late (or the same frame twice, with other panels: a paused engine), and
    missing messages a newer rerun cut off (Streamlit never sends them), always ends up with every
    panel of the redraw it draws. Keyed by frame, a cut-off message of the frame the browser held
    left its panels recorded as sent: a block-table toggle on a travelled view was never drawn."""
    h, _ = busy_history(seed=7, ops=300)
    rng = random.Random(8)
    points = sorted(rng.sample(range(h.first_event, h.last_event + 1), 40))
    frames = [grid.build(view_at(h, n), {}) for n in points]
    frames += [frames[-1]] * 30  # no new event: the same frame again, its panels changing
    by_token = {f.token: f for f in frames}
    sent: list[int] = []
    ledger = grid.PanelLedger()
    held, acked, acked_msg, left_out, cut = {}, None, None, 0, 0
    for i, frame in enumerate(frames):
        panels = {"status": f"status {i // 3}", "metrics": {"used": i // 2}, "card": "same", "travel": [i]}
        also = grid.unacknowledged(sent, acked, frame.token)
        base = by_token.get(acked)
        msg, out = ledger.out(panels, acked_msg, base is not None)
        left_out += len(panels) - len(out)
        data = grid.message(frame, base, {"msg": msg, "panels": out}, [by_token[t] for t in also] if base else [])
        if 0 < i < len(frames) - 1 and rng.random() < 0.25:  # cut off by the next rerun: never arrives
            cut += 1
            continue
        held, applied = canvas(held, data)
        assert applied and held["panels"] == panels, f"redraw {i}: the browser holds {held['panels']}"
        if rng.random() < 0.4:  # the sync names the frame and the message it holds
            acked, acked_msg = held["token"], held["msg"]
    assert left_out > len(frames) and cut > 5  # unchanged panels did stay home; messages were lost


def test_the_time_travel_buttons_go_where_they_say():
    edges = {100: (90, 110)}
    edge = lambda n, forward: edges[n][forward]  # noqa: E731
    from app.ui.travel import destination
    assert destination("prev_step", 100, 50, 200, edge) == 90
    assert destination("next_step", 100, 50, 200, edge) == 110
    assert destination("prev", 100, 50, 200, edge) == 99 and destination("prev", 50, 50, 200, edge) == 50
    assert destination("next", 100, 50, 200, edge) == 101
    assert destination("next", 199, 50, 200, edge) is None  # the last event: live
    assert destination("live", 100, 50, 200, edge) is None


def test_a_block_tables_chips_say_what_the_hover_says_at_every_event():
    """At a mid-step event (a block cached for the token this step computes, before the
    append) the table's chip and the grid's hover show one token count."""
    h, _ = busy_history(seed=5, ops=300)
    chip = re.compile(r'title="logical \d+ → physical block (\d+) · (\d+)/(\d+) tokens')
    checked = 0
    for n in range(h.first_event, h.last_event + 1, 3):
        view = view_at(h, n)
        frame = grid.build(view, {})
        for b, held, _ in chip.findall(tables.render(view, {})):
            assert int(held) == int(frame.dev["tokens"][int(b)]), (n, b)
            checked += 1
    assert checked > 1000


def test_the_timeline_counts_used_blocks_by_the_contracts_rule():
    """A pool with a reserved block (vLLM's null block, which the engine's free count leaves
    out): the timeline's used blocks equal the header's, which leave the reserved block out."""
    from kvscope_contract.state import PoolState
    cfg = p.PoolConfig(block_size=4, num_device_blocks=16, num_host_blocks=0, reserved_blocks=[0])
    h = EventHistory(PoolState.empty(cfg).snapshot())
    evs = [p.RequestAdded(request_id="r1", seq_id="r1", prompt_tokens=9, max_tokens=4),
           *(p.Alloc(seq_id="r1", block_id=b, logical_index=i) for i, b in enumerate((1, 2, 3))),
           p.StatusChange(seq_id="r1", status="running"), p.Append(seq_id="r1", num_tokens=9, token_ids=[5]),
           p.StepDone(num_running=1, num_waiting=0, num_swapped=0, prefill_tokens=9, decode_tokens=0,
                      duration_ms=5.0, free_blocks=12, cached_blocks=0)]
    for i, ev in enumerate(evs, 1):
        ev.seq, ev.step = i, 1
        h.append(ev)
    point, counts = h.points[-1], h.live.state.counts()
    assert (point.used, point.cached, point.free) == (counts.used, counts.cached, counts.free) == (3, 0, 12)
