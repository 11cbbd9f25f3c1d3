"""The page of a ZMQ KV-event source (`--kv-events tcp://HOST:5557`): what such a stream can
show, and a plain statement of what it cannot. It carries content hashes only, so there are
no block ids, ref counts or request tables here: the cached blocks per medium (and, for a
hybrid model, per KV-cache group), the prefix forest their parent hashes form (each prefix
once, however many groups store it), stored / removed / cleared over time, and every frame that
could not be read.
"""
from __future__ import annotations

import html
from pathlib import Path

import streamlit as st

from app.panels.prefix_tree import render
from app.link.source import Source
from kvscope_contract.prefix_forest import Node
from integrations.kv_events.model import Extra, GroupSpec, KVEventsState, tier_label
from integrations.kv_events.subscriber import KVEventsSubscriber


@st.cache_resource(show_spinner=False, max_entries=4, on_release=KVEventsSubscriber.close)
def subscribed(url: str) -> KVEventsSubscriber:
    return KVEventsSubscriber(url)


@st.cache_resource(show_spinner=False, max_entries=4)
def tokenizer(folder: str):
    """A tokenizer.json read with `tokenizers` (no transformers, no torch); None if absent."""
    path = Path(folder).expanduser() / "tokenizer.json"
    if not folder or not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def block_text(node: Node, tok) -> str:
    """The text of a block's tokens (its token ids without a tokenizer)."""
    if tok is None:
        return " ".join(map(str, node.tokens))
    return tok.decode(list(node.tokens), skip_special_tokens=False)


def rates_chart(state: KVEventsState) -> dict:
    pts = list(state.points)
    t0 = pts[0].ts if pts else 0.0
    rows = [{"t": round(b.ts - t0, 3), "what": what, "per s": round(n / max(b.ts - a.ts, 1e-3), 1)}
            for a, b in zip(pts, pts[1:])
            for what, n in (("stored", b.stored - a.stored), ("removed", b.removed - a.removed),
                            ("cleared", b.cleared - a.cleared))]
    return {"data": {"values": rows}, "mark": {"type": "line", "interpolate": "step-after"},
            "encoding": {"x": {"field": "t", "type": "quantitative", "title": "seconds"},
                         "y": {"field": "per s", "type": "quantitative", "title": "blocks per second"},
                         "color": {"field": "what", "type": "nominal"}}, "height": 220}


def chip_text(node: Node, tok, held: dict[str, list[int]], groups: int, extras: dict[str, Extra]) -> str:
    """A block's text, with what its hash covers beyond its tokens (LoRA, cache salt) and, on a
    hybrid model, the groups that hold it when not all of them do (a sliding window's early
    blocks leave those groups first)."""
    text = block_text(node, tok)
    if (extra := extras.get(node.key)) is not None and (label := extra.label()):
        text = f"[{label}] {text}"
    have = held.get(node.key, [])
    if groups > 1 and len(have) < groups:
        text += f"  (groups {', '.join(map(str, have))} of {groups})"
    return text


def group_rows(state: KVEventsState) -> list[dict]:
    """One row per KV-cache group: its kind and window, its cached blocks per tier."""
    tiers = state.tiers()
    return [{"group": g, "kind": state.specs.get(g, GroupSpec()).label(),
             **{f"blocks on {t}": state.per_group(t).get(g, 0) for t in tiers}} for g in state.groups()]


def page(source: Source) -> None:
    st.title("KVScope · KV events")
    st.caption("A KV-event stream (vLLM `--kv-events-config`, SGLang, TensorRT-LLM) carries content "
               "hashes only: no block ids, ref counts or request tables. This page shows what is "
               "cached and how prefixes share it; for the pool itself, run vLLM with the KVScope "
               "plugin (`make run-vllm`).")
    try:
        sub = subscribed(source.url)
    except ValueError as e:
        st.error(str(e))
        return
    tok = tokenizer(source.tokenizer)

    @st.fragment(run_every=1.0)
    def live() -> None:
        with sub.lock:
            s = sub.state
            media = s.per_medium()
            groups = s.groups()
            head = (f"`{source.url}` · {s.batches} batches (last #{s.last_seq}) · {s.stored} stored · "
                    f"{s.removed} removed · {s.cleared} cleared")
            health = (s.bad_frames, s.unknown_events, s.missed, s.removed_unknown, list(s.errors)[-5:])
            chart = rates_chart(s)
            content = {m: (s.prefixes(m), s.duplicated(m)) for m in media}
            rows = group_rows(s) if len(groups) > 1 else []
            forests = {}
            for m in sorted(media):
                forest, held = s.forest(m)
                forests[m] = render(forest, text=lambda n, held=held: chip_text(n, tok, held, len(groups), s.extras))
        st.markdown(head)
        cols = st.columns(max(1, len(media)) + 1)
        for col, (m, n) in zip(cols, sorted(media.items())):
            prefixes, dup = content[m]
            col.metric(f"cached on {tier_label(m)}", n, help="physical blocks, every KV-cache group's; an "
                       "offloading server's host tier (vLLM's CPU, SGLang's CPU_TIER1) counts each block once "
                       "however often it is announced")
            col.caption(f"{prefixes:,} blocks of content · {dup:,} duplicated"
                        + (f" · {len(groups)} KV-cache groups" if len(groups) > 1 else ""))
        bad, unknown, missed, orphan, errors = health
        cols[-1].metric("unreadable", bad + unknown, help="frames and events that could not be read")
        if bad or unknown or missed or orphan:
            st.warning(f"{bad} unreadable frames · {unknown} unknown events · {missed} batches missed "
                       f"(sequence gaps) · {orphan} removals of blocks stored before this page subscribed"
                       + ("".join(f"\n- {html.escape(e)}" for e in errors)))
        if rows:
            st.subheader("KV-cache groups")
            st.caption(f"A hybrid model: {len(groups)} groups of layers, each storing its own blocks of every "
                       "prompt under the same hashes, so a prefix is one block of content per group, not "
                       "duplicated content. Duplicated counts a group holding the same content twice.")
            st.dataframe(rows, hide_index=True, width="stretch")
        left, right = st.columns([3, 2])
        with left:
            st.subheader("Prefix forest")
            if not forests:
                st.info("No cached block yet: send the server a request.")
            for m, body in forests.items():
                st.caption(f"{tier_label(m)}: each block (its hash and the text of its tokens) under the block "
                           "its prefix continues; a row is a chain, branches are where prompts part; hover a block "
                           "for its tokens"
                           + ("; each block once, however many KV-cache groups store it" if rows else ""))
                st.html(body)
        with right:
            st.subheader("Stored, removed, cleared")
            st.vega_lite_chart(chart, width="stretch")

    live()
