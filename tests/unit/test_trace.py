"""Trace import: the Mooncake JSONL format read line by line, and every rule it checks, each
error naming the file and line (engine/lab/trace.py); the exact reuse ceiling it computes."""
from __future__ import annotations

import json

import pytest

from engine.lab.trace import TraceError, check_block_size, read_trace, scan
from engine.lab.trace_sweep import sweep
from tests.traces import ceiling_512, mooncake, req, write


GOOD = [req(0, [0, 1, 2]), req(5, [0, 1, 3], 1100), req(5, [0, 4])]


def test_reads_a_good_trace_and_its_slice(tmp_path):
    path = write(tmp_path, GOOD)
    rows = list(read_trace(path))
    assert [r.hash_ids for r in rows] == [[0, 1, 2], [0, 1, 3], [0, 4]]
    assert rows[1].input_length == 1100 and rows[1].timestamp == 5
    assert len(list(read_trace(path, limit=2))) == 2


@pytest.mark.parametrize("line, words", [
    ("{not json", "malformed"),
    ('{"timestamp": 1, "input_length": 512, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 1, "input_length": "512", "output_length": 1, "hash_ids": [9]}', "input_length"),
    (json.dumps(req(9, [0, 1], 1500)), "2 hash_ids for input_length 1500"),
    (json.dumps(req(9, [7, 1])), "was seen in an earlier request but follows hash_ids[0] = 7"),
    (json.dumps(req(9, [1])), "follows nothing here but 0"),
    (json.dumps(req(2, [0, 9])), "timestamp 2 is before the previous line's 5"),
    (json.dumps(req(9, [0, 9], out=0)), "output_length must be at least 1"),
    (json.dumps(req(9, [0, -4])), "ids are integers from 0"),
    (json.dumps(req(9, [0, 2 ** 32 - 1])), "ids are integers from 0"),
    ("", "empty line"),
])
def test_each_bad_line_is_named(tmp_path, line, words):
    path = write(tmp_path, GOOD + [line, req(9, [0, 5])])
    with pytest.raises(TraceError) as e:
        list(read_trace(path))
    assert f"{path}:4:" in str(e.value) and words in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


def test_a_block_size_must_divide_512(tmp_path):
    path = write(tmp_path, GOOD)
    for bs in (3, 24, 1024, 0):
        with pytest.raises(TraceError, match="does not divide the trace's 512-token blocks"):
            scan(path, bs)
    for bs in (1, 16, 128, 512):
        check_block_size(bs)


def test_nothing_runs_before_the_whole_file_is_checked(tmp_path):
    """A bad last line stops a sweep before its first replay."""
    path = write(tmp_path, [req(i, [i]) for i in range(30)] + ["{"])
    ran = []
    with pytest.raises(TraceError, match=":31:"):
        sweep(path, [64], ["lru"], progress=ran.append)
    assert ran == []
    assert len(sweep(path, [64], ["lru"], requests=30, progress=ran.append).points) == 1 == len(ran)


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_the_scan_ceiling_is_the_hash_ids_own(name):
    path = mooncake(name)
    ix = scan(path, 512, 2000)
    assert (ix.ceiling_hit_tokens, ix.prompt_tokens) == ceiling_512(path, 2000)
    assert ix.requests == 2000 and 0 < ix.ceiling < 1


def test_the_ceiling_never_covers_a_prompts_last_token(tmp_path):
    """A prompt of exactly 2 blocks repeated hits 1 (its last block holds the last token); one of
    1,100 tokens repeated hits 2; a third prompt sharing only the first id hits 1."""
    path = write(tmp_path, [req(0, [0, 1]), req(1, [0, 1]), req(2, [2, 3, 4], 1100), req(3, [2, 3, 4], 1100),
                            req(4, [0, 9])])
    ix = scan(path, 512)
    assert ix.ceiling_hit_tokens == 512 + 1024 + 512
    assert scan(path, 256).ceiling_hit_tokens == 768 + 1024 + 512  # (1024 - 1) // 256 = 3 blocks of 256
    assert ix.blocks_needed == 5 * 3 and ix.largest_request == 3  # prompt + 4 outputs: 3 blocks each
