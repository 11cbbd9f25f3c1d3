"""`kvscope-explain RECORDING.jsonl` (engine/lab/explain.py): the reasons account for every missed
token of the bundled demo and of a fresh recording, and the what-ifs are the lab's replays."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvscope_contract.misses import REASONS

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "assets" / "demo_recording.jsonl"


def explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.lab.explain", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_the_demo_recordings_missed_tokens_each_have_a_reason():
    out = explain(str(DEMO), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["prompts_rebuilt"] == doc["admissions"] > 0  # it has no prompt token ids
    assert sum(doc["missed"].values()) == doc["looked_up"] - doc["hit"] > 0
    assert doc["missed"]["unknown"] == 0 and doc["missed"]["evicted"] > 0
    assert doc["evicted"] and all(e["by_seq"] for case in doc["evicted"] for e in case["evictions"])
    assert len(doc["what_if"]) == 3 and doc["what_if"][1].startswith("+")
    text = explain(str(DEMO))
    assert text.returncode == 0, text.stderr
    assert f"why the other {doc['looked_up'] - doc['hit']:,} tokens missed" in text.stdout
    assert "what would have hit (a replay of this recording's requests" in text.stdout


def test_a_recording_with_prompt_ids_tells_diverged_and_evicted_and_twice_the_blocks_recovers_the_evicted(tmp_path):
    """The lab's chat mix (system prompts of 160, 280 and 400 tokens, blocks of 16: the 280-token one
    parts from the others inside block 17) recorded on a 64-block pool."""
    rec = tmp_path / "chat.jsonl"
    subprocess.run([sys.executable, "-m", "engine.lab", "chat", "--blocks", "64", "--record", str(rec)], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    doc = json.loads(explain(str(rec), "--json").stdout)
    assert doc["prompts_rebuilt"] == 0
    missed = doc["missed"]
    assert set(missed) == set(REASONS) and sum(missed.values()) == doc["looked_up"] - doc["hit"]
    assert missed["diverged"] > 0 and missed["evicted"] > 0 and missed["cold"] > 0 and missed["partial_block"] > 0
    base, twice = doc["what_if"][:2]
    assert twice.startswith(f"+{missed['evicted']:,} tokens with 2× blocks (128 × 16)"), (base, twice)


def test_a_file_that_is_no_recording_is_said_plainly(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text("{}\n")
    out = explain(str(bad))
    assert out.returncode == 2 and out.stderr.startswith("kvscope-explain: ") and "Traceback" not in out.stderr
