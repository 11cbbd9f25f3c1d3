"""Sidebar controls: where the events come from, prompts, scenario presets, the engine's
pause / step / pace / run-to-next-key-event, abort, prefix-cache clearing and clean slate, and
a reset with a new pool. Everything that shows the engine's state redraws with it, in every
tab (`engine_panel` is a fragment on a timer)."""
from __future__ import annotations

import itertools
from pathlib import Path

import streamlit as st

from kvscope_contract import protocol as p
from kvscope_contract.kinds import KINDS
from app.link import gate
from app.link.client import EngineClient, View
from app.ui import stale
from app.ui.commands import last_error, send
from app.ui.connection import Hosted, restart
from app.derived.key_events import KEY_KINDS
from app.derived.scenarios import SCENARIOS, Scenario
from app.link.source import VLLM_PYTHON, Source, recordings
from app.derived.words import plural

SOURCE_KINDS = {"embedded": "Embedded engine", "attach": "Attach to a running engine", "replay": "Replay a recording",
         "vllm": "vLLM with the KVScope plugin", "kv_events": "KV events of a server (ZMQ)",
                "fleet": "A fleet of engines", "trace": "Play a request trace"}
PACES = (0, 20, 50, 100, 200, 500, 1000, 2000)
_runs = itertools.count(1)  # scenario runs, process-wide: request ids stay unique across sessions


def connection(source: Source, client: EngineClient | None, hosted: Hosted | None) -> None:
    """Choose the source. Connect and Restart act in their click's callback, before the run they
    start draws anything: a busy page's fragments may cut that run short, and must not lose the click.
    The panel is open while there is no live connection, and from the user's first change in it
    until Connect: Streamlit applies a changed `expanded` over the user's own opening, so a
    connection made (or made again) must not close the panel under a choice being made."""
    choosing = dict(on_change=_choosing, args=(source,))
    expanded = client is None or client.status.state != "connected" or st.session_state.get(CHOOSING) == source
    with st.expander("Connection", expanded=expanded):
        if client is not None and client.notices:
            for t, level, text in list(client.notices)[-3:]:
                st.caption(f"{'⚠️' if level == 'warning' else '❌'} {text}")
        kind = st.radio("Source", list(SOURCE_KINDS), format_func=SOURCE_KINDS.get,
                        index=list(SOURCE_KINDS).index(source.kind), key="src_kind", **choosing)
        if kind == "embedded":
            st.text_input("Model", source.model if source.kind == "embedded" else "smollm2",
                          help="smollm2 (bundled SmolLM2-135M-Instruct), tiny (random weights, fast) "
                               "or a local Hugging Face Llama-family folder", key="src_model", **choosing)
        elif kind == "attach":
            st.text_input("Engine URL", source.url or "ws://127.0.0.1:8765/", key="src_url", **choosing)
            # never the token it was started with: what a widget holds, the browser holds
            st.text_input("Token", type="password", key="src_token", **choosing,
                          placeholder="the one given on the command line" if source.token else "",
                          help="Needed when the engine was started with --token")
        elif kind == "vllm":
            st.text_input("Model", source.model if source.kind == "vllm" else "smollm2", key="src_vllm",
                          **choosing,
                          help="smollm2 (bundled) or a model folder; vLLM runs from .venv-vllm (make vllm-venv)")
        elif kind == "kv_events":
            st.text_input("Endpoint", source.url or "tcp://127.0.0.1:5557", key="src_zmq", **choosing,
                          help="the PUB socket; add ?replay=tcp://HOST:PORT to catch up, ?topic=T to filter")
            st.text_input("Tokenizer folder (optional)", source.tokenizer, key="src_tok", **choosing,
                          help="a folder with tokenizer.json, to show the text of each block")
        elif kind == "trace":
            st.text_input("Trace file", source.path if source.kind == "trace" else "", key="src_trace",
                          **choosing,
                          help="A request trace (docs/traces.md); the Lab's Trace workload plays one with its curve")
        elif kind == "fleet":
            st.text_input("Fleet file (optional)", source.path if source.kind == "fleet" else "", key="src_fleet",
                          **choosing,
                          help="a TOML file listing engines (docs/fleet.md); empty: add them on the fleet page")
        else:
            files = [str(f) for f in recordings()]
            if source.kind == "replay" and source.path not in files:
                files.insert(0, source.path)
            picked = st.selectbox("Recording", files + [OTHER_FILE], format_func=lambda f: Path(f).name,
                                  index=files.index(source.path) if source.path in files else 0, key="src_file",
                                  **choosing)
            if picked == OTHER_FILE or not files:
                st.text_input("Path to a recording (.jsonl)", key="src_path", **choosing)
            st.select_slider("Speed", [0.25, 0.5, 1.0, 2.0, 4.0, 8.0], source.speed, key="src_speed",
                             **choosing)
        if error := st.session_state.pop(CONNECT_ERROR, None):
            st.error(error)
        cols = st.columns(2)
        cols[0].button("Connect", type="primary", disabled=chosen(source, st.session_state) == source,
                       width="stretch", on_click=_connect, args=(source,))
        if source.kind in ("embedded", "replay", "vllm", "trace"):
            cols[1].button({"embedded": "Restart engine", "replay": "Restart replay",
                            "vllm": "Restart vLLM", "trace": "Play it again"}[source.kind],
                           width="stretch", on_click=restart, args=(source,),
                           help="Start it again (an engine with the pool config and pace it last had)")
        if hosted is not None:
            hosted.auto_restart = st.toggle(
                "Restart it when it dies", hosted.auto_restart, key="auto_restart",
                help="Off: a dead engine is shown with its last lines and waits for Restart")


OTHER_FILE = "other file…"
CONNECT_ERROR = "connect_error"  # session state: why the last Connect was refused
CHOOSING = "choosing_source"  # session state: the source the Connection panel was changed under


def _choosing(source: Source) -> None:
    """on_change of the Connection panel's widgets: it stays open until Connect changes the source."""
    st.session_state[CHOOSING] = source
    stale.mark()


def _path(text: str) -> str:
    return str(Path(text).expanduser().resolve()) if text.strip() else ""


def chosen(source: Source, values) -> Source:
    """The source the Connection panel's widgets (their values by key) describe."""
    kind = values.get("src_kind", source.kind)
    if kind == "embedded":
        return Source("embedded", model=values.get("src_model", "").strip() or "smollm2",
                      engine_args=source.engine_args if source.kind == "embedded" else ())
    if kind == "attach":
        url = values.get("src_url", "").strip()
        kept = source.token if source.kind == "attach" and url == source.url else ""  # the command line's
        return Source("attach", url=url, token=values.get("src_token", "").strip() or kept)
    if kind == "vllm":
        return Source("vllm", model=values.get("src_vllm", "").strip() or "smollm2",
                      engine_args=source.engine_args if source.kind == "vllm" else ())
    if kind == "kv_events":
        return Source("kv_events", url=values.get("src_zmq", "").strip(), tokenizer=values.get("src_tok", "").strip())
    if kind == "fleet":
        return Source("fleet", path=_path(values.get("src_fleet", "")))
    if kind == "trace":
        return Source("trace", path=_path(values.get("src_trace", "")),
                      engine_args=source.engine_args if source.kind == "trace" else ())
    picked = values.get("src_file") or OTHER_FILE
    if picked == OTHER_FILE:
        picked = values.get("src_path", "")
    return Source("replay", path=_path(picked), speed=values.get("src_speed", source.speed))


def _refusal(new: Source) -> str | None:
    if new.kind == "attach" and not new.url.startswith(("ws://", "wss://")):
        return "The URL must start with ws:// or wss://"
    if new.kind == "replay" and not Path(new.path).is_file():
        return f"No recording at {new.path}"
    if new.kind == "vllm" and not VLLM_PYTHON.exists():
        return "vLLM is not installed here: `make vllm-venv` builds .venv-vllm (about 5 minutes)"
    if new.kind == "trace" and not Path(new.path).is_file():
        return f"No trace at {new.path}"
    if new.kind == "fleet" and new.path and not Path(new.path).is_file():
        return f"No fleet file at {new.path}"
    if new.kind == "kv_events" and not new.url.startswith(("tcp://", "ipc://")):
        return "The endpoint must start with tcp:// or ipc://"
    return None


def _connect(source: Source) -> None:
    """Connect's callback: the session's new source, or why not."""
    new = chosen(source, st.session_state)
    try:
        gate.check()  # a new source starts processes and opens connections: the presenter's call
    except gate.Refused as e:
        st.session_state[CONNECT_ERROR] = str(e)
        return
    if error := _refusal(new):
        st.session_state[CONNECT_ERROR] = error
    else:
        st.session_state.update({"source": new, "travel": None})


def prompt_form(client: EngineClient) -> None:
    disabled = not client.supports("submit")
    with st.form("prompt", border=False):
        st.text_area("Prompt", "Explain in two sentences how a paged KV cache saves memory.", height=90,
                     key="prompt_text")
        c = st.columns(3)
        c[0].number_input("n", 1, 16, 1, help="parallel samples sharing the prompt's blocks", key="prompt_n")
        c[1].number_input("max tokens", 1, 4096, 96, key="prompt_max")
        c[2].number_input("temperature", 0.0, 2.0, 0.0, 0.1, key="prompt_temp", help="0 = greedy")
        with st.expander("More"):
            st.toggle("Chat template", True, key="prompt_chat",
                      help="Wrap the prompt as a user message of the model's chat template")
            st.number_input("seed (0 = none)", 0, 2**31, 0, key="prompt_seed")
            st.toggle("Ignore end of text", False, key="prompt_ignore_eos", help="Always generate max tokens")
        # in its callback: a click that reaches the server with a fragment's rerun still submits (app/ui/stale.py)
        st.form_submit_button("Submit", type="primary", disabled=disabled, width="stretch", on_click=_submit,
                              args=(client,))
    if st.session_state.pop(PROMPT_EMPTY, False):
        st.error("Write a prompt first.")


PROMPT_EMPTY = "prompt_empty"  # session state: Submit was pressed on an empty prompt


def _submit(client: EngineClient) -> None:
    v = st.session_state
    text = v["prompt_text"]
    if not text.strip():
        v[PROMPT_EMPTY] = True
        stale.mark()
        return
    body = {"messages": [p.ChatMessage("user", text)]} if v["prompt_chat"] else {"prompt": text}
    send(client, p.Submit(**body, n=int(v["prompt_n"]), max_tokens=int(v["prompt_max"]),
                          temperature=float(v["prompt_temp"]), seed=int(v["prompt_seed"]) or None,
                          ignore_eos=v["prompt_ignore_eos"]), "Submit")


def unsupported_note(client: EngineClient) -> None:
    if client.is_replay:
        st.info("Replaying a recording: prompts, scenarios and resets need a live engine.")
    elif client.hello and client.hello.supports is not None:
        st.info(f"{client.hello.server} does not take every command: the controls it cannot "
                "carry out are disabled.")


def _not_here(client: EngineClient, op: str) -> str | None:
    if client.supports(op):
        return None
    return f"{client.hello.server if client.hello else 'This server'} cannot do this"


def clean_slate(client: EngineClient) -> None:
    """Drop what the last scenario left in the prefix cache and count afresh; the history
    before stays reachable by time travel."""
    if client.supports("clear_prefix_cache"):
        send(client, p.ClearPrefixCache(), "Clear the prefix cache", quiet=True)
    client.clean_slate()
    st.session_state["travel"] = None


LAST_SCENARIO = "last_scenario"  # session state: the scenario started last, whose caption says what to watch


def scenarios(client: EngineClient, view: View) -> None:
    cfg = view.mirror.config
    st.toggle("Start from a clean slate", True, key="scenario_clean",
              help="Before the scenario: clear the prefix cache and start the counters and "
                   "the timeline afresh (the history before stays reachable by time travel)")
    for sc in SCENARIOS:
        st.button(sc.title, key=f"scenario_{sc.key}", help=sc.watch(cfg), width="stretch",
                  disabled=not client.supports("submit"), on_click=_run_scenario, args=(client, sc, cfg))
    if (key := st.session_state.get(LAST_SCENARIO)) is not None:
        sc = next(s for s in SCENARIOS if s.key == key)
        st.caption(f"**Watch:** {sc.watch(cfg)}.")


def _run_scenario(client: EngineClient, sc: Scenario, cfg: p.PoolConfig) -> None:
    cmds = sc.build(cfg, next(_runs))
    if st.session_state["scenario_clean"]:
        clean_slate(client)
    sent = [c for c in cmds if send(client, c, f"{sc.title}: " + (
        f"reset to {c.config.num_device_blocks} blocks" if isinstance(c, p.ResetCmd) else
        f"submit {c.request_id}"), quiet=True)]
    if ids := [c.request_id for c in sent if isinstance(c, p.Submit)]:
        st.toast(f"{sc.title}: {', '.join(ids)}", icon=":material/play_circle:")
    st.session_state["travel"] = None
    st.session_state[LAST_SCENARIO] = sc.key


def _track_engine(key: str, engine_value) -> None:
    """Keep a widget on the engine's value when the engine changes it (another tab, a reset),
    without fighting the user's own edits in between."""
    seen = f"{key}__engine"
    if st.session_state.get(seen) != engine_value:
        st.session_state[seen] = st.session_state[key] = engine_value


def pacing(client: EngineClient) -> None:
    loop = client.loop
    c = st.columns(2)
    # One key per meaning: a click that Streamlit delivers twice, once after the button was
    # redrawn with the other meaning, must not undo itself.
    action = "Resume" if loop.paused else "Pause"
    c[0].button(action, key=action.lower(), width="stretch",
                icon=":material/play_arrow:" if loop.paused else ":material/pause:",
                type="primary" if loop.paused else "secondary", disabled=_not_here(client, "pause") is not None,
                on_click=send, args=(client, p.Resume() if loop.paused else p.Pause(), action, True))
    c[1].button("Step", icon=":material/redo:", key="step", width="stretch", disabled=not loop.paused,
                help="Run engine steps (pause first)", on_click=_step, args=(client,))
    st.number_input("steps per Step", 1, 1000, 1, key="step_count")
    _track_engine("pace", min(PACES, key=lambda v: abs(v - loop.step_delay_ms)))
    st.select_slider("Pace (ms between steps)", PACES, key="pace",
                     on_change=lambda: send(client, p.Pace(step_delay_ms=st.session_state["pace"]),
                                            f"Pace {st.session_state['pace']} ms", quiet=True),
                     help="Slow the engine down so a human can follow each step (0 = full speed)")
    kinds = st.session_state.get("until_kinds", list(KEY_KINDS))
    st.button("Run to the next key event", icon=":material/fast_forward:", key="run_until", width="stretch",
              disabled=not kinds or _not_here(client, "run_until") is not None, on_click=_run_until, args=(client,),
              help="Run steps until a prefix hit, a fork, a copy-on-write, an eviction, a swap or a "
                   "preemption (as chosen below), then pause and explain it")
    with st.expander("Key events to stop at"):
        st.multiselect("Stop at", KEY_KINDS, default=list(KEY_KINDS), key="until_kinds",
                       format_func=lambda k: KINDS[k].label, label_visibility="collapsed")
    if loop.until:
        st.caption(f":material/fast_forward: running until: {', '.join(KINDS[k].label for k in loop.until)}")


def _step(client: EngineClient) -> None:
    send(client, p.StepCmd(count=int(st.session_state.get("step_count", 1))), "Step", quiet=True)
    st.session_state["travel"] = None


def _run_until(client: EngineClient) -> None:
    send(client, p.RunUntil(kinds=st.session_state.get("until_kinds", list(KEY_KINDS))),
         "Run to the next key event", quiet=True)
    st.session_state["travel"] = None


def _abort(client: EngineClient) -> None:
    if rid := st.session_state.get("abort_rid"):
        send(client, p.Abort(request_id=rid), f"Abort {rid}")


def requests(client: EngineClient, view: View) -> None:
    rids = sorted({s.request_id for s in view.mirror.state.seqs.values()})
    c = st.columns([3, 2])
    rid = c[0].selectbox("Request", rids, key="abort_rid", label_visibility="collapsed", index=None,
                         placeholder="request to abort" if rids else "no live request")
    c[1].button("Abort", key="abort", disabled=not rid or _not_here(client, "abort") is not None, width="stretch",
                on_click=_abort, args=(client,))
    caching = view.mirror.config.enable_prefix_caching
    st.button("Clear prefix cache", key="clear_cache", width="stretch",
              disabled=not caching or _not_here(client, "clear_prefix_cache") is not None,
              help="Evict every cached block that no sequence holds" if caching else "Prefix caching is off",
              on_click=send, args=(client, p.ClearPrefixCache(), "Clear the prefix cache"))
    st.button("Clean slate", key="clean_slate", width="stretch", on_click=clean_slate, args=(client,),
              help="Clear the prefix cache and start counters and timeline afresh; the history "
                   "before stays reachable by time travel")


def reset_form(client: EngineClient, cfg: p.PoolConfig) -> None:
    """A new pool, starting from the engine's. Its widgets take the pool's values as their own
    defaults under keys named after the pool: a fresh tab's browser sends back what it was
    given (a form widget whose value came only through session state came back as its minimum
    in some tabs, and Reset applied it), and a pool changed by another tab or a reset gets
    widgets of its own; the user's edits stand while the pool stays."""
    pool = (f"{cfg.block_size}-{cfg.num_device_blocks}-{cfg.num_host_blocks}-{cfg.max_num_seqs}-"
            f"{cfg.preemption_mode}-{cfg.enable_prefix_caching:d}-{cfg.num_offload_blocks}")
    with st.form("reset", border=False):
        st.select_slider("Block size (tokens)", p.BLOCK_SIZES, cfg.block_size, key=f"reset_bs@{pool}",
                         help="Small: little waste, long tables. Large: short tables, more waste.")
        c = st.columns(2)
        c[0].number_input("Device blocks", 1, p.MAX_DEVICE_BLOCKS, cfg.num_device_blocks, key=f"reset_dev@{pool}")
        c[1].number_input("Host blocks", 0, p.MAX_HOST_BLOCKS, cfg.num_host_blocks, key=f"reset_host@{pool}")
        c = st.columns(2)
        c[0].number_input("Max running", 1, p.MAX_NUM_SEQS, cfg.max_num_seqs, key=f"reset_seqs@{pool}")
        modes = ["swap", "recompute"]
        c[1].selectbox("Preemption", modes, modes.index(cfg.preemption_mode), key=f"reset_mode@{pool}")
        st.toggle("Prefix caching", cfg.enable_prefix_caching, key=f"reset_caching@{pool}")
        st.number_input("Host tier blocks", 0, p.MAX_HOST_BLOCKS, cfg.num_offload_blocks, key=f"reset_tier@{pool}",
                        help="Offloading (docs/offload.md): full blocks are stored to the host tier as they "
                             "complete, and a prefix the device missed is loaded back from there. 0: none.")
        st.caption("A reset aborts every request; the model stays loaded.")
        st.form_submit_button("Reset engine", width="stretch", disabled=_not_here(client, "reset") is not None,
                              on_click=_reset, args=(client, pool))


def _reset(client: EngineClient, pool: str) -> None:
    names = ("bs", "dev", "host", "seqs", "mode", "caching", "tier")
    v = {name: st.session_state[f"reset_{name}@{pool}"] for name in names}
    send(client, p.ResetCmd(config=p.ResetConfig(
        block_size=int(v["bs"]), num_device_blocks=int(v["dev"]), num_host_blocks=int(v["host"]),
        max_num_seqs=int(v["seqs"]), preemption_mode=v["mode"], enable_prefix_caching=v["caching"],
        num_offload_blocks=int(v["tier"]))),
        f"Reset to {int(v['dev'])} × {int(v['bs'])}")
    st.session_state["travel"] = None


def engine_panel(client: EngineClient, view: View) -> None:
    """Everything in the sidebar that follows the engine (a fragment body: it redraws on a timer)."""
    cfg = view.mirror.config
    st.subheader("Scenarios")
    scenarios(client, view)
    st.subheader("Engine")
    pacing(client)
    requests(client, view)
    st.caption(f"Pool: {plural(cfg.num_device_blocks, 'block')} × {plural(cfg.block_size, 'token')} · "
               f"{plural(cfg.num_host_blocks, 'host block')} · "
               + (f"{plural(cfg.num_offload_blocks, 'block')} in the host tier · " if cfg.num_offload_blocks else "")
               + "prefix caching "
               f"{'on' if cfg.enable_prefix_caching else 'off'} · {cfg.preemption_mode}")
    if client.supports("reset"):
        with st.expander("Reset pool"):
            reset_form(client, cfg)
    if err := last_error():
        st.caption(f":red[Last error:] {err}")
