"""Sidebar controls: where the events come from, prompts, scenario presets, the engine's
pause / step / pace, abort and prefix-cache clearing, and a reset with a new pool."""
from __future__ import annotations

import itertools
from pathlib import Path

import streamlit as st

from engine.contract import protocol as p
from app.client import EngineClient, View
from app.commands import send
from app.connection import Hosted, restart
from app.scenarios import SCENARIOS
from app.source import Source, recordings

KINDS = {"embedded": "Embedded engine", "attach": "Attach to a running engine", "replay": "Replay a recording"}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
PACES = (0, 20, 50, 100, 200, 500, 1000, 2000)
_runs = itertools.count(1)  # scenario runs, process-wide: request ids stay unique across sessions


def connection(source: Source, client: EngineClient | None, hosted: Hosted | None) -> None:
    """Choose the source; a change is stored in the session and the app reruns on it."""
    with st.expander("Connection", expanded=client is None or client.status.state != "connected"):
        if client is not None and client.notices:
            for t, level, text in list(client.notices)[-3:]:
                st.caption(f"{'⚠️' if level == 'warning' else '❌'} {text}")
        kind = st.radio("Source", list(KINDS), format_func=KINDS.get, index=list(KINDS).index(source.kind),
                        key="src_kind")
        if kind == "embedded":
            model = st.text_input("Model", source.model if source.kind == "embedded" else "smollm2",
                                  help="smollm2 (bundled SmolLM2-135M-Instruct), tiny (random weights, fast) "
                                       "or a local Hugging Face Llama-family folder", key="src_model")
            new = Source("embedded", model=model.strip() or "smollm2",
                         engine_args=source.engine_args if source.kind == "embedded" else ())
        elif kind == "attach":
            url = st.text_input("Engine URL", source.url or "ws://127.0.0.1:8765/", key="src_url")
            token = st.text_input("Token", source.token, type="password", key="src_token",
                                  help="Needed when the engine was started with --token")
            new = Source("attach", url=url.strip(), token=token.strip())
        else:
            files = [str(f) for f in recordings()]
            if source.kind == "replay" and source.path not in files:
                files.insert(0, source.path)
            picked = st.selectbox("Recording", files + ["other file…"], format_func=lambda f: Path(f).name,
                                  index=files.index(source.path) if source.path in files else 0, key="src_file")
            if picked == "other file…" or not files:
                picked = st.text_input("Path to a recording (.jsonl)", key="src_path")
            speed = st.select_slider("Speed", [0.25, 0.5, 1.0, 2.0, 4.0, 8.0], source.speed, key="src_speed")
            new = Source("replay", path=str(Path(picked).expanduser().resolve()) if picked else "", speed=speed)
        cols = st.columns(2)
        if cols[0].button("Connect", type="primary", disabled=new == source, width="stretch"):
            if new.kind == "attach" and not new.url.startswith(("ws://", "wss://")):
                st.error("The URL must start with ws:// or wss://")
            elif new.kind == "replay" and not Path(new.path).is_file():
                st.error(f"No recording at {new.path}")
            else:
                st.session_state["source"] = new
                st.session_state["travel"] = None
                st.rerun()
        if source.kind != "attach" and cols[1].button(
                "Restart engine" if source.kind == "embedded" else "Restart replay", width="stretch"):
            restart(source)
            st.rerun()


def prompt_form(client: EngineClient, disabled: bool) -> None:
    with st.form("prompt", border=False):
        text = st.text_area("Prompt", "Explain in two sentences how a paged KV cache saves memory.",
                            height=90, key="prompt_text")
        c = st.columns(3)
        n = c[0].number_input("n", 1, 16, 1, help="parallel samples sharing the prompt's blocks", key="prompt_n")
        max_tokens = c[1].number_input("max tokens", 1, 4096, 96, key="prompt_max")
        temperature = c[2].number_input("temperature", 0.0, 2.0, 0.0, 0.1, key="prompt_temp",
                                        help="0 = greedy")
        with st.expander("More"):
            chat = st.toggle("Chat template", True, key="prompt_chat",
                             help="Wrap the prompt as a user message of the model's chat template")
            seed = st.number_input("seed (0 = none)", 0, 2**31, 0, key="prompt_seed")
            ignore_eos = st.toggle("Ignore end of text", False, key="prompt_ignore_eos",
                                   help="Always generate max tokens")
        if st.form_submit_button("Submit", type="primary", disabled=disabled, width="stretch"):
            if not text.strip():
                st.error("Write a prompt first.")
                return
            body = {"messages": [p.ChatMessage("user", text)]} if chat else {"prompt": text}
            send(client, p.Submit(**body, n=int(n), max_tokens=int(max_tokens), temperature=float(temperature),
                                  seed=int(seed) or None, ignore_eos=ignore_eos), "Submitted")


def scenarios(client: EngineClient, view: View, disabled: bool) -> None:
    for sc in SCENARIOS:
        if st.button(sc.title, key=f"scenario_{sc.key}", help=sc.watch, disabled=disabled,
                     width="stretch"):
            run = next(_runs)
            cmds = sc.build(view.mirror.config, run)
            for i, cmd in enumerate(cmds):
                label = (f"{sc.title}: pool reset to {cmd.config.num_device_blocks} blocks"
                         if isinstance(cmd, p.ResetCmd) else sc.title)
                if not send(client, cmd, label, quiet=i > 0 and not isinstance(cmd, p.ResetCmd)):
                    break
            st.session_state["travel"] = None
            st.session_state["last_scenario"] = sc.key
    if (key := st.session_state.get("last_scenario")) is not None:
        sc = next(s for s in SCENARIOS if s.key == key)
        st.caption(f"**Watch:** {sc.watch}.")


def _pause(client: EngineClient, pause: bool) -> None:
    if send(client, p.Pause() if pause else p.Resume(), "Paused" if pause else "Resumed"):
        client.paused = pause  # in a callback, so this run already draws the new state


def engine(client: EngineClient, view: View, replay: bool) -> None:
    c = st.columns(2)
    paused = client.paused
    c[0].button("Resume" if paused else "Pause", icon=":material/play_arrow:" if paused else ":material/pause:",
                key="pause_resume", width="stretch", type="primary" if paused else "secondary",
                on_click=_pause, args=(client, not paused))
    if c[1].button("Step", icon=":material/redo:", key="step", width="stretch", disabled=not client.paused,
                   help="Run one engine step (pause first)"):
        send(client, p.StepCmd(count=int(st.session_state.get("step_count", 1))), "Stepped", quiet=True)
        st.session_state["travel"] = None
    st.number_input("steps per Step", 1, 1000, 1, key="step_count")
    st.select_slider("Pace (ms between steps)", PACES, value=min(PACES, key=lambda v: abs(v - client.pace_ms)),
                     key="pace", on_change=lambda: send(client, p.Pace(step_delay_ms=st.session_state["pace"]),
                                                         f"Pace {st.session_state['pace']} ms"),
                     help="Slow the engine down so a human can follow each step (0 = full speed)")
    if replay:
        return
    rids = sorted({s.request_id for s in view.mirror.state.seqs.values()})
    c = st.columns([3, 2])
    rid = c[0].selectbox("Request", rids, key="abort_rid", label_visibility="collapsed",
                         placeholder="pick a request to abort" if rids else "no live request", index=None)
    if c[1].button("Abort", key="abort", disabled=not rid, width="stretch"):
        send(client, p.Abort(request_id=rid), f"Aborted {rid}")
    if st.button("Clear prefix cache", key="clear_cache", width="stretch",
                 help="Evict every cached block that no sequence holds"):
        send(client, p.ClearPrefixCache(), "Prefix cache cleared")


def reset_form(client: EngineClient, view: View) -> None:
    cfg = view.mirror.config
    with st.form("reset", border=False):
        bs = st.select_slider("Block size (tokens)", BLOCK_SIZES, cfg.block_size, key="reset_bs",
                              help="Small: little waste, long tables. Large: short tables, more waste.")
        c = st.columns(2)
        dev = c[0].number_input("Device blocks", 1, 65536, cfg.num_device_blocks, key="reset_dev")
        host = c[1].number_input("Host blocks", 0, 65536, cfg.num_host_blocks, key="reset_host")
        c = st.columns(2)
        seqs = c[0].number_input("Max running", 1, 256, cfg.max_num_seqs, key="reset_seqs")
        mode = c[1].selectbox("Preemption", ["swap", "recompute"], ["swap", "recompute"].index(cfg.preemption_mode),
                              key="reset_mode")
        caching = st.toggle("Prefix caching", cfg.enable_prefix_caching, key="reset_caching")
        st.caption(f"Now: {cfg.num_device_blocks} × {cfg.block_size} tokens = "
                   f"{cfg.num_device_blocks * cfg.block_size:,} token slots. A reset aborts every request; "
                   "the model stays loaded.")
        if st.form_submit_button("Reset engine", width="stretch"):
            send(client, p.ResetCmd(config=p.ResetConfig(
                block_size=int(bs), num_device_blocks=int(dev), num_host_blocks=int(host),
                max_num_seqs=int(seqs), preemption_mode=mode, enable_prefix_caching=caching)),
                f"Reset: {int(dev)} blocks of {int(bs)}")
            st.session_state["travel"] = None
