"""Kernels: the torch path against naive attention, and every Triton kernel, run by the Triton
interpreter on CPU, against the torch path.

The interpreter is chosen when a kernel is decorated (TRITON_INTERPRET at import time), and other
test files may import `kernels` and triton first. So `triton_interpreter()` does in-process, for
one test, what TRITON_INTERPRET=1 at import would: every @triton.jit function (ours and
triton.language's own, such as tl.max) becomes an InterpretedFunction of the same source; on exit
it puts everything back, including the triton.language patches that nested interpreted calls leave
behind (the interpreter never undoes those), so later compilations in the process are unaffected.
"""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

import kernels
from kernels import metadata
from tests.attention_cases import CASES, LONG, MIXED, WINDOWS, close, make_batch, naive_attention


@contextlib.contextmanager
def triton_interpreter():
    originals = {}  # (id(owner), name) -> (owner, name, value before the first change)

    def swap(owner, name, value):
        originals.setdefault((id(owner), name), (owner, name, getattr(owner, name, interpreter._MISSING)))
        setattr(owner, name, value)

    def patch_lang(fn, _patch=interpreter._patch_lang):
        scope = _patch(fn)
        for owner, name, value in scope._changes:
            originals.setdefault((id(owner), name), (owner, name, value))
        return scope

    env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # for the knobs read while running
    swap(interpreter, "_patch_lang", patch_lang)
    owners = [m for n, m in list(sys.modules.items()) if n.startswith(("triton.language", "kernels."))]
    for owner in owners + [tl.tensor]:
        for name, obj in list(vars(owner).items()):
            if isinstance(obj, JITFunction):
                swap(owner, name, interpreter.InterpretedFunction(obj.fn))
    try:
        yield
    finally:
        for owner, name, value in originals.values():
            if value is interpreter._MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
        if env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = env


@pytest.fixture
def interpret():
    with triton_interpreter():
        yield


@pytest.mark.parametrize("case", ["mixed", "decode_ragged", "chunked_prefill", "many_decodes", "long"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_attention_in_a_sliding_window_matches_naive(monkeypatch, case, block_size, window):
    """GQA 4 on one KV head (Gemma 3's shape); blocks before each window are NULL in the tables."""
    monkeypatch.setattr(metadata, "DECODE_CHUNK_TOKENS", 100)
    specs = LONG if case == "long" else CASES[case]
    query, kv, meta, fk, fv = make_batch(specs, block_size, 1, 4, seed=window, window=window)
    out = kernels.paged_attention(query, kv[0, 0], kv[0, 1], meta, 0.3)
    close(out, naive_attention(query, fk, fv, specs, 4, 0.3, window))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 3)])
def test_torch_attention_matches_naive(monkeypatch, case, block_size, kv_heads, group):
    monkeypatch.setattr(metadata, "DECODE_CHUNK_TOKENS", 100)  # several decode batches per step
    specs = CASES[case]
    query, kv, meta, fk, fv = make_batch(specs, block_size, kv_heads, group, seed=block_size + group)
    out = kernels.paged_attention(query, kv[0, 0], kv[0, 1], meta, 0.3)
    close(out, naive_attention(query, fk, fv, specs, group, 0.3))


def test_torch_attention_in_and_out_of_inference_mode():
    query, kv, meta, fk, fv = make_batch(MIXED, 8, 2, 3)
    with torch.inference_mode():  # as the engine runs it; the gather workspace outlives the call
        first = kernels.paged_attention(query, kv[0, 0], kv[0, 1], meta, 0.3)
    close(kernels.paged_attention(query, kv[0, 0], kv[0, 1], meta, 0.3), first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_attention_half(dtype):
    query, kv, meta, fk, fv = make_batch(MIXED, 16, 1, 3, dtype=dtype)
    out = kernels.paged_attention(query, kv[0, 0], kv[0, 1], meta, 0.25)
    assert out.dtype == dtype
    close(out, naive_attention(query, fk, fv, MIXED, 3, 0.25), dtype)


def test_metadata_layout():
    meta = kernels.build_attention_metadata([3, 1, 1, 1], [7, 9, 1, 5], [[4, 2], [0, 5, 1], [3], [6, 7]],
                                            list(range(6)), 4, "cpu")
    assert meta.query_start_loc.tolist() == [0, 3, 4, 5, 6] and meta.query_start_loc.dtype == torch.int32
    assert meta.block_tables.tolist() == [[4, 2, 0], [0, 5, 1], [3, 0, 0], [6, 7, 0]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64 and (meta.max_query_len, meta.max_seq_len) == (3, 9)
    (d,) = meta.decodes  # sorted by length: rows 4 (1 token), 5 (5), 3 (9)
    assert d.rows.tolist() == [4, 5, 3] and d.blocks.tolist() == [3, 0, 0, 6, 7, 0, 0, 5, 1] and d.num_seqs == 3
    assert d.seq_len == 9 and d.mask.shape == (3, 1, 1, 9) and d.mask.isinf().sum((1, 2, 3)).tolist() == [8, 4, 0]
    (p,) = meta.prefills
    assert (p.start, p.end, p.seq_len, p.blocks.tolist()) == (0, 3, 7, [4, 2])
    assert p.mask.shape == (3, 7) and p.mask.isinf().sum(1).tolist() == [2, 1, 0]


def test_decode_batches_split_by_tokens(monkeypatch):
    monkeypatch.setattr(metadata, "DECODE_CHUNK_TOKENS", 64)
    lens = [40, 8, 30, 30, 9, 64, 100]
    meta = kernels.build_attention_metadata([1] * 7, lens, [list(range(-(-n // 8))) for n in lens],
                                            list(range(7)), 8, "cpu")
    assert [(d.seq_len, d.mask is None) for d in meta.decodes] == [
        (9, False), (30, True), (40, True), (64, True), (100, True)]
    assert [d.rows for d in meta.decodes][1] == slice(2, 4)


def store_inputs(block_size, dtype=torch.float32):
    g = torch.Generator().manual_seed(block_size)
    kv = torch.randn(1, 2, 6, block_size, 3, 16, generator=g).to(dtype)
    slots = [5 * block_size + 3, -1, 0, 2 * block_size + block_size - 1, -1, 4 * block_size + 1]
    key = torch.randn(len(slots), 3, 16, generator=g).to(dtype)
    value = torch.randn(len(slots), 3, 16, generator=g).to(dtype)
    return key, value, kv, slots


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_store_kv_torch(block_size):
    key, value, kv, slots = store_inputs(block_size)
    expected = kv.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expected[0, 0, s // block_size, s % block_size] = key[t]
            expected[0, 1, s // block_size, s % block_size] = value[t]
    kernels.store_kv(key, value, kv[0, 0], kv[0, 1], torch.tensor(slots))
    assert torch.equal(kv, expected)


def block_pairs_inputs(num_layers=3, blocks=7, block_size=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(num_layers, 2, blocks, block_size, 2, 16, generator=g), [(1, 4), (6, 0), (2, 5)]


def test_copy_and_swap_torch():
    kv, pairs = block_pairs_inputs()
    expected = kv.clone()
    for s, d in pairs:
        expected[:, :, d] = kv[:, :, s]
    kernels.copy_blocks(kv, pairs)
    assert torch.equal(kv, expected)
    host = torch.zeros(3, 2, 9, 8, 2, 16)
    kernels.swap_blocks(kv, host, [(4, 8), (0, 1)])
    assert torch.equal(host[:, :, 8], kv[:, :, 4]) and torch.equal(host[:, :, 1], kv[:, :, 0])
    assert host[:, :, [0, 2, 3, 4, 5, 6, 7]].abs().sum() == 0
    kernels.copy_blocks(kv, [])
    kernels.swap_blocks(kv, host, [])


# ---------------------------------------------------------------- Triton kernels, interpreted
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_triton(interpret, block_size, dtype):
    key, value, kv, slots = store_inputs(block_size, dtype)
    expected = kv.clone()
    kernels.store_kv_torch(key, value, expected[0, 0], expected[0, 1], torch.tensor(slots))
    strided_key = torch.cat([key, value], 1)[:, :3]  # as if sliced from a fused projection
    kernels.store_kv_triton(strided_key, value, kv[0, 0], kv[0, 1], torch.tensor(slots))
    assert torch.equal(kv, expected)


TRITON_CASES = {
    "mixed": [(0, 7), (5, 1), (20, 1), (13, 6), (9, 1)],
    "decode": [(4, 1), (30, 1), (0, 1)],
    "chunked_prefill": [(17, 9), (0, 12)],
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 3)])
def test_paged_attention_triton(interpret, case, block_size, kv_heads, group):
    specs = TRITON_CASES[case]
    query, kv, meta, fk, fv = make_batch(specs, block_size, kv_heads, group, seed=block_size)
    expected = kernels.paged_attention_torch(query, kv[0, 0], kv[0, 1], meta, 0.3)
    # block_m 16 with group 3 (padded to 4): 4 positions per tile, so prefill chunks span tiles
    out = kernels.paged_attention_triton(query, kv[0, 0], kv[0, 1], meta, 0.3, block_m=16, block_n=16)
    close(out, expected)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_attention_triton_in_a_sliding_window(interpret, window, block_size):
    """Decode rows, prefill chunks with and without cached prefixes, NULL entries before each window."""
    specs = [(70, 1), (45, 9), (0, 30), (13, 1), (2, 1)]
    query, kv, meta, fk, fv = make_batch(specs, block_size, 1, 4, seed=window, window=window)
    out = kernels.paged_attention_triton(query, kv[0, 0], kv[0, 1], meta, 0.3, block_m=16, block_n=16)
    close(out, naive_attention(query, fk, fv, specs, 4, 0.3, window))


def test_paged_attention_triton_fp16(interpret):
    # half precision under the interpreter is float16: its tl.dot multiplies the raw bits of
    # bfloat16 (triton-lang/triton#11584, "not supported yet"); bench/kernels_cuda.py checks bf16
    query, kv, meta, fk, fv = make_batch(MIXED, 16, 2, 3, dtype=torch.float16)
    out = kernels.paged_attention_triton(query, kv[0, 0], kv[0, 1], meta, 0.25)
    close(out, naive_attention(query, fk, fv, MIXED, 3, 0.25), torch.float16)


def test_block_copy_triton(interpret):
    kv, pairs = block_pairs_inputs()
    expected = kv.clone()
    kernels.copy_blocks_torch(expected, pairs)
    kernels.copy_blocks_triton(kv, pairs)
    assert torch.equal(kv, expected)
    host, expected_host = torch.zeros(3, 2, 9, 8, 2, 16), torch.zeros(3, 2, 9, 8, 2, 16)
    kernels.swap_blocks_torch(kv, expected_host, [(4, 8), (0, 1)])
    kernels.swap_blocks_triton(kv, host, [(4, 8), (0, 1)])  # same device: the kernel does it all
    assert torch.equal(host, expected_host)


def test_interpreter_leaves_triton_untouched():
    spaces = (tl, tl.core, tl.math, tl.standard, tl.tensor, tl.dtype, tl.condition, kernels.attention, interpreter)
    before = [dict(vars(ns)) for ns in spaces]
    with triton_interpreter():
        query, kv, meta, _, _ = make_batch([(3, 2), (7, 1)], 8, 2, 3)
        kernels.paged_attention_triton(query, kv[0, 0], kv[0, 1], meta, 0.3)  # uses tl.max, tl.sum
    for ns, old in zip(spaces, before):  # names the interpreter adds to module globals may stay
        assert {k: v for k, v in vars(ns).items() if k in old} == old, ns


# ------------------------------------------- the same kernels compiled for a GPU (no GPU needed)
def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Pointer args as given, constexprs as such, every other argument a 32-bit int (strides are
    passed as Python ints; the qk scale is the only float)."""
    return {a: pointers.get(a, "constexpr" if a in constexprs else "fp32" if a == "qk_scale" else "i32")
            for a in fn.arg_names}


@pytest.mark.parametrize("dtype,block_size,group,block_m",
                         [("fp32", 16, 3, 16), ("bf16", 8, 1, 64), ("fp16", 32, 3, 64)])
def test_kernels_compile_for_sm90(monkeypatch, tmp_path, dtype, block_size, group, block_m):
    """The interpreter runs Python, not the compiler: this catches what only compilation checks
    (tl.dot minimum shapes, constexpr use, types) by building cubins for sm_90 with ptxas."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    from kernels.attention import _paged_attention_kernel
    from kernels.block_copy import _block_copy_kernel
    from kernels.store import _store_kv_kernel
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the current default; silences its warning
    ptr = "*" + dtype
    jobs = [
        (_paged_attention_kernel, {a: ptr for a in ("query", "k_cache", "v_cache", "out")}
         | {a: "*i32" for a in ("query_start_loc", "seq_lens", "block_tables")},
         dict(BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=64,
              BLOCK_M=block_m, BLOCK_N=32, PRECISION="ieee" if dtype == "fp32" else "tf32")),
        (_store_kv_kernel, {a: ptr for a in ("key", "value", "k_cache", "v_cache")} | {"slots": "*i64"},
         dict(BLOCK_SIZE=block_size, NUM_HEADS=3, HEAD_DIM=64, HEADS_PAD=4)),
        (_block_copy_kernel, {"src": ptr, "dst": ptr, "src_ids": "*i64", "dst_ids": "*i64"}, dict(BLOCK=1024)),
    ]
    for fn, pointers, constexprs in jobs:
        src = ASTSource(fn, _signature(fn, pointers, constexprs), constexprs)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
