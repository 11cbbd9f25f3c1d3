"""Hostile recordings: a file anyone may hand over is read a line at a time within a bound, with
the pools it names and the order of its events checked; what is whole before the damage is
kept, and the tools (replay, export, explain, the lab) say where it stopped, never die of it."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvscope_contract.recording import Recording

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "assets" / "demo_recording.jsonl"
LINES = DEMO.read_bytes().splitlines()


def write(tmp_path: Path, lines: list[bytes], name: str = "rec.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def whole_events(lines: list[bytes]) -> int:
    return sum(len(json.loads(x)["events"]) for x in lines if json.loads(x)["type"] == "events")


def test_a_huge_line_costs_the_bound_not_the_file_and_what_came_before_is_kept(tmp_path):
    path = write(tmp_path, LINES[:100] + [b'{"type":"events","events":[' + b" " * (48 << 20) + b"]}"] + LINES[100:])
    tracemalloc.start()
    try:
        rec = Recording(path, max_line_bytes=4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak:,} bytes held to read a 48 MB line"  # the old reader held the whole file
    assert rec.damage.startswith("line 101 is longer than 4,194,304 bytes")
    assert rec.num_events == whole_events(LINES[:100])


def test_a_stream_that_never_ends_a_line_is_refused_at_the_bound():
    with pytest.raises(ValueError, match="not a KVScope recording.*line 1 is longer than 1,048,576 bytes"):
        Recording(Path("/dev/zero"), max_line_bytes=1 << 20)


def test_deep_nesting_out_of_order_events_and_damage_end_the_reading_there_saying_where(tmp_path):
    deep = b'{"type":"ack","op":"x","id":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    rec = Recording(write(tmp_path, LINES[:50] + [deep] + LINES[50:]))
    assert rec.damage.startswith(f"line 51 of {len(LINES) + 1} is damaged") and "recursion" in rec.damage
    assert rec.num_events == whole_events(LINES[:50]) and "lines 51-" in rec.damage
    swapped = LINES[:60] + [LINES[61], LINES[60]] + LINES[62:]  # two batches out of order
    rec = Recording(write(tmp_path, swapped))
    assert rec.damage.startswith("line 61 of") and "does not follow" in rec.damage
    assert rec.num_events == whole_events(LINES[:60])
    rec = Recording(write(tmp_path, LINES[:-1] + [LINES[-1][: len(LINES[-1]) // 2]]))  # a killed engine's last line
    assert rec.damage.startswith(f"line {len(LINES)} of {len(LINES)} is cut short") and rec.cut_short


@pytest.mark.parametrize("field, value", [("num_device_blocks", 10**12), ("num_host_blocks", 10**9),
                                          ("block_size", 1 << 20), ("max_num_seqs", 10**9)])
def test_a_pool_beyond_the_protocols_bounds_is_refused_before_anything_is_allocated(tmp_path, field, value):
    hello = json.loads(LINES[0])
    hello["config"][field] = value
    with pytest.raises(ValueError, match=f"beyond KVScope's bounds: {field} {value:,} is outside"):
        Recording(write(tmp_path, [json.dumps(hello).encode()] + LINES[1:]))
    snap = json.loads(LINES[1])
    snap["config"][field] = value
    with pytest.raises(ValueError, match="snapshot names a pool beyond"):
        Recording(write(tmp_path, [LINES[0], json.dumps(snap).encode()] + LINES[2:]))


def test_a_recording_names_no_server_for_the_dashboard_to_reach(tmp_path):
    hello = json.loads(LINES[0])
    hello["api_url"] = "http://attacker.example:8000"
    rec = Recording(write(tmp_path, [json.dumps(hello).encode()] + LINES[1:]))
    assert rec.hello.api_url is None and not rec.damage


def test_export_explain_and_the_lab_say_when_a_recording_was_cut_short(tmp_path):
    from app.export import perfetto
    from engine.lab.workload import from_recording

    cut = write(tmp_path, LINES[:300] + [LINES[300][:100]], "cut.jsonl")
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        assert perfetto.main([str(cut), "-o", str(tmp_path / "cut.pftrace")]) == 0
    assert "note: the recording was cut short: line 301 of 301 is cut short" in err.getvalue()
    assert f"only its {whole_events(LINES[:300]):,} whole events" in err.getvalue()
    done = subprocess.run([sys.executable, "-m", "engine.lab.explain", str(cut), "--no-what-if"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "note: the recording was cut short: line 301" in done.stdout, done.stderr
    assert any("cut short: line 301" in note for note in from_recording(cut).notes)
    huge = json.loads(LINES[0])
    huge["config"]["num_device_blocks"] = 10**12
    err = io.StringIO()
    with redirect_stderr(err):
        assert perfetto.main([str(write(tmp_path, [json.dumps(huge).encode()] + LINES[1:])),
                              "-o", str(tmp_path / "x.pftrace")]) == 2
    assert err.getvalue().startswith("kvscope-export: ") and "num_device_blocks 1,000,000,000,000" in err.getvalue()
