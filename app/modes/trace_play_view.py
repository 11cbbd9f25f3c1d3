"""Watch a request trace in the pool: the Lab's Trace workload plays one capacity under one policy
through the real allocator (`python -m engine.lab.trace_play`, a child server like the embedded
engine's: app/modes/lab_trace_view.py `play_form`), and the live views (grid, block tables, misses,
time travel) draw its events as they draw an engine's. Above the pool, the sweep's curve with the
point being played marked: its capacity and policy, and the hit rate so far at the event shown
(live, or travelled to).
"""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from kvscope_contract.lab import TraceSweep
from app.link.client import EngineClient
from app.link.source import Source
from app.modes.lab_trace_view import PLAYING, PRODUCTION_BLOCKS, chart
from app.ui import travel



def playing_point(source: Source, client: EngineClient, n: int | None) -> dict | None:
    """The point being played at event `n` (None: live): its capacity and policy, and the hit rate
    of the tokens looked up so far."""
    view = client.view(n)
    if view is None:
        return None
    tally = view.mirror.tally
    blocks = int(source.trace_option("--blocks", str(PRODUCTION_BLOCKS)))
    policy = source.trace_option("--policy", "lru")
    rate = tally.hit_tokens / tally.looked_up_tokens if tally.looked_up_tokens else 0.0
    where = "live" if view.live else f"event {view.event:,}"
    lost = client.status.resyncs  # events the engine dropped for a snapshot: their lookups were not seen
    gap = f" (counted over the events seen: {lost} gaps)" if lost else ""
    return {"blocks": blocks, "policy": policy, "hit rate": rate, "label": f"{policy.upper()} {rate:.1%} so far",
            "description": f"playing {policy} at {blocks} blocks: hit rate {rate:.4f} so far, "
                           f"{tally.hit_tokens} of {tally.looked_up_tokens} tokens, at {where} "
                           f"(event {view.event}){gap}"}


def curve(client: EngineClient, source: Source) -> None:
    """The sweep's curve with the played point marked, or (played without a sweep) its hit rate."""
    point = playing_point(source, client, travel.target())
    if point is None:
        return
    sweep: TraceSweep | None = st.session_state.get(PLAYING)
    if sweep is None or Path(sweep.trace).name != Path(source.path).name:
        st.caption(f"Playing {Path(source.path).name}: {point['description']}. The Lab's Trace workload "
                   "sweeps it and marks this point on the curve.")
        return
    with st.expander(f"Capacity curve: {point['description']}", expanded=True):
        st.vega_lite_chart(chart(sweep, point, height=220), width="stretch", key="play_curve")
