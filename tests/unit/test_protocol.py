"""Every message survives encode/decode; every malformed command gets its own error code."""
from __future__ import annotations

import json

import msgspec
import pytest

from kvscope_contract import protocol as p
from kvscope_contract.state import RESERVED, InvariantError, PoolState

CONFIG = p.PoolConfig(block_size=16, num_device_blocks=4, num_host_blocks=2,
                      bytes_per_block=737280)
EVENTS = [
    p.RequestAdded(request_id="r1", seq_id="r1", prompt_tokens=20, n=2, max_tokens=8),
    p.Fork(request_id="r1", parent_seq_id="r1", seq_id="r1.1", block_ids=[3, 1]),
    p.Alloc(seq_id="r1", block_id=3, logical_index=0),
    p.PrefixHit(seq_id="r1", block_id=3, logical_index=0, hash="00ff00ff00ff00ff"),
    p.Cached(block_id=3, hash="00ff00ff00ff00ff", parent_hash=None),
    p.Evict(block_id=3, hash="00ff00ff00ff00ff"),
    p.Cow(seq_id="r1.1", logical_index=1, src_block_id=1, dst_block_id=2),
    p.Free(seq_id="r1", block_id=3, ref_count=0),
    p.WindowFree(seq_id="r1", kv_group=1, logical_index=0, block_id=2, ref_count=0),
    p.Preempt(seq_id="r1", mode="swap"),
    p.SwapOut(seq_id="r1", mapping=[(3, 0), (1, 1)]),
    p.SwapIn(seq_id="r1", mapping=[(0, 2), (1, 0)]),
    p.Append(seq_id="r1", num_tokens=20, token_ids=[42], text=" hi"),
    p.StatusChange(seq_id="r1", status="running"),
    p.Finish(seq_id="r1", reason="length"),
    p.StepDone(num_running=1, num_waiting=0, num_swapped=0, prefill_tokens=20,
               decode_tokens=0, duration_ms=3.5, free_blocks=2, cached_blocks=0),
    p.Reset(config=CONFIG),
    p.OffloadStore(block_id=3, offload_block_id=0, hash="00ff00ff00ff00ff"),
    p.OffloadLoad(seq_id="r1", offload_block_id=0, block_id=2, logical_index=0, hash="00ff00ff00ff00ff"),
    p.OffloadEvict(offload_block_id=0, hash="00ff00ff00ff00ff"),
]
MESSAGES = [
    p.Hello(engine=p.EngineInfo(model="tiny", device="cpu", dtype="float32", num_layers=2,
                                num_kv_heads=1, head_dim=16), config=CONFIG),
    PoolState.empty(CONFIG, last_event=7).snapshot(),
    p.Events(events=EVENTS),
    p.Ack(op="submit", id={"any": ["json", 1]}, request_id="r1", seq_ids=["r1", "r1.1"]),
    p.Ack(op="pause", id=3),
    p.Error(code="too_long", message="never fits", op="submit", id="x"),
]


def test_every_event_kind_is_covered():
    assert {e.__struct_config__.tag for e in EVENTS} == set(p.EVENT_KINDS)


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.__struct_config__.tag)
def test_event_round_trip(event):
    event.seq, event.t, event.step = 12, 0.25, 3
    data = p.encode(event)
    assert p.decode_event(data) == event
    obj = json.loads(data)
    assert obj["kind"] == event.__struct_config__.tag and obj["seq"] == 12


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.__struct_config__.tag)
def test_server_message_round_trip(msg):
    assert p.decode_server_message(p.encode(msg)) == msg


def test_ack_carries_request_fields_only_for_submit():
    assert json.loads(p.encode(p.Ack(op="pause", id=1))) == {"type": "ack", "op": "pause", "id": 1}


def test_snapshot_matches_the_documented_shape():
    obj = json.loads(p.encode(MESSAGES[1]))
    assert obj["type"] == "snapshot" and obj["seq"] == 7
    assert obj["device_blocks"][0] == {"id": 0, "ref_count": 0, "hash": None, "num_tokens": 0}
    assert obj["host_blocks"][1] == {"id": 1, "seq_id": None, "num_tokens": 0, "ref_count": 0}


COMMANDS = [
    {"op": "submit", "prompt": "Hello", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9,
     "n": 4, "seed": 1, "ignore_eos": True, "request_id": "mine", "id": 1},
    {"op": "submit", "messages": [{"role": "user", "content": "Hi"}]},
    {"op": "abort", "request_id": "mine"},
    {"op": "pause"}, {"op": "resume"}, {"op": "step", "count": 3},
    {"op": "reset", "config": {"block_size": 8, "num_device_blocks": 64, "num_host_blocks": 0,
                               "enable_prefix_caching": False, "preemption_mode": "recompute",
                               "max_num_seqs": 4}},
    {"op": "reset"}, {"op": "pace", "step_delay_ms": 250}, {"op": "snapshot"},
    {"op": "clear_prefix_cache", "id": "c"},
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c["op"])
def test_command_round_trip(cmd):
    parsed = p.parse_command(json.dumps(cmd))
    assert parsed.__struct_config__.tag == cmd["op"]
    assert p.parse_command(p.encode(parsed).decode()) == parsed


BAD = [
    ("{not json", "bad_json"),
    (b'{"op": "pause"}', "bad_json"),  # binary frame
    ("[" * 50_000, "bad_json"),
    ('"just a string"', "invalid_argument"),
    ("{}", "unknown_op"),
    ('{"op": 7}', "unknown_op"),
    ('{"op": "explode"}', "unknown_op"),
    ('{"op": "submit"}', "invalid_argument"),
    ('{"op": "submit", "prompt": ""}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "max_tokens": 0}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "max_tokens": 1e400}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "max_tokens": 99999999999999999999999}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "max_tokens": "5"}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "n": true}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "top_p": 0}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "temperature": -1}', "invalid_argument"),
    ('{"op": "submit", "prompt": "a", "maxtokens": 3}', "invalid_argument"),
    ('{"op": "submit", "messages": [{"role": "robot", "content": "b"}]}', "invalid_argument"),
    ('{"op": "abort"}', "invalid_argument"),
    ('{"op": "step", "count": 0}', "invalid_argument"),
    ('{"op": "pace", "step_delay_ms": 10001}', "invalid_argument"),
    ('{"op": "reset", "config": {"block_size": 12}}', "invalid_argument"),
    ('{"op": "reset", "config": {"num_device_blocks": -1}}', "invalid_argument"),
    ('{"op": "reset", "config": {"preemption_mode": "pray"}}', "invalid_argument"),
    ('{"op": "reset", "config": {"colour": "red"}}', "invalid_argument"),
]


@pytest.mark.parametrize("frame,code", BAD)
def test_malformed_command_gets_its_code(frame, code):
    with pytest.raises(p.CommandError) as info:
        p.parse_command(frame)
    err = info.value.to_message()
    assert err.code == code and len(err.message) > 10
    assert json.loads(p.encode(err))["type"] == "error"


def test_error_echoes_the_id_and_op():
    with pytest.raises(p.CommandError) as info:
        p.parse_command('{"op": "step", "count": -3, "id": [1, "two"]}')
    assert (info.value.op, info.value.id) == ("step", [1, "two"])
    assert "count" in info.value.message


def test_reset_config_changes_only_what_it_names():
    cmd = p.parse_command('{"op": "reset", "config": {"block_size": 32}}')
    assert cmd.config.apply_to(CONFIG) == msgspec.structs.replace(CONFIG, block_size=32)


def test_reducer_names_the_event_that_breaks_an_invariant():
    state = PoolState.empty(CONFIG)
    state.apply(p.RequestAdded(seq=1, request_id="r1", seq_id="r1", prompt_tokens=3))
    state.apply(p.Alloc(seq=2, seq_id="r1", block_id=0, logical_index=0))
    with pytest.raises(InvariantError, match=r"event 3 \(alloc\).*block 0 is not free"):
        state.apply(p.Alloc(seq=3, seq_id="r1", block_id=0, logical_index=1))
    with pytest.raises(InvariantError, match=r"event 5 .* does not follow event 2"):
        state.apply(p.Free(seq=5, seq_id="r1", block_id=0, ref_count=0))
    with pytest.raises(InvariantError, match=r"event 3 \(free\).*ref_count 0 after the free, the event says 1"):
        state.apply(p.Free(seq=3, seq_id="r1", block_id=0, ref_count=1))


@pytest.mark.parametrize("event,message", [
    (p.Alloc(seq_id="ghost", block_id=0, logical_index=0), "no live sequence 'ghost'"),
    (p.Alloc(seq_id="r1", block_id=99, logical_index=0), "outside the pool"),
    (p.Alloc(seq_id="r1", block_id=0, logical_index=5), "skips past the end"),
    (p.PrefixHit(seq_id="r1", block_id=0, logical_index=0, hash="ab"), "carries hash None"),
    (p.Evict(block_id=0, hash="ab"), "not a cached block"),
    (p.Cached(block_id=0, hash="ab"), "no sequence holds it"),
    (p.Finish(seq_id="nobody", reason="stop"), "no live sequence"),
    (p.Append(seq_id="r1", num_tokens=17), "holds 17 tokens in 0 blocks"),
    (p.SwapIn(seq_id="r1", mapping=[(0, 0)]), "does not cover"),
])
def test_reducer_rejects_impossible_events(event, message):
    state = PoolState.empty(CONFIG)
    state.apply(p.RequestAdded(seq=1, request_id="r1", seq_id="r1", prompt_tokens=3))
    event.seq = 2
    with pytest.raises(InvariantError, match=message):
        state.apply(event)


def test_the_example_session_in_the_docs_still_holds():
    """docs/protocol.md's transcript: every line is a valid message of today's protocol, its
    events replay onto its snapshot, and its error says what the server says today."""
    from pathlib import Path

    from engine.serve.hub import Pacing

    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    session = doc.split("## Example session", 1)[1]
    lines = [ln for ln in session.splitlines() if ln.startswith(("< ", "> "))]
    assert len(lines) >= 8
    msgs = []
    for ln in lines:
        if ln.startswith("> "):
            p.parse_command(ln[2:])
        else:  # the snapshot's block lists are cut short with "..."
            msgs.append(p.decode_server_message(ln[2:].replace(',"..."', "")))
    hello, snap = msgs[0], msgs[1]
    assert isinstance(hello, p.Hello) and isinstance(snap, p.Snapshot) and snap.config == hello.config
    state = PoolState.from_snapshot(snap)  # the blocks cut from it are free, as the missing ones here
    for m in msgs:
        for ev in m.events if isinstance(m, p.Events) else []:
            state.apply(ev)
    (error,) = [m for m in msgs if isinstance(m, p.Error)]
    with pytest.raises(p.CommandError) as e:
        Pacing().handle(p.StepCmd())
    assert (error.code, error.message) == (e.value.code, e.value.message)


def test_reserved_blocks_are_counted_in_no_state_and_never_allocated():
    """vLLM's null block: `config.reserved_blocks` (an addition) keeps it out of the free count."""
    st = PoolState.empty(p.PoolConfig(num_device_blocks=4, num_host_blocks=0, reserved_blocks=[0]))
    st.apply(p.RequestAdded(request_id="r", seq_id="r", prompt_tokens=3, seq=1))
    st.apply(p.Alloc(seq_id="r", block_id=1, logical_index=0, seq=2))
    assert st.block_states().tolist() == [RESERVED, 2, 0, 0]
    assert st.counts()[:3] == (2, 0, 1)
    with pytest.raises(InvariantError, match="reserved"):
        st.apply(p.Alloc(seq_id="r", block_id=0, logical_index=1, seq=3))
    old = p.decode_server_message(b'{"type":"hello","engine":{"model":"m","device":"cpu","dtype":"f",'
                                  b'"num_layers":1,"num_kv_heads":1,"head_dim":1},"config":{}}')
    assert old.config.reserved_blocks == []  # a v1 server that never sends it
