"""The C++ CPU kernels (torch.ops.kvscope_<isa>) against the torch path and naive attention, and
the CPU GEMM backend choice. Each kernel test runs once per variant (avx512, avx2, generic) this
CPU can execute; the others are skipped with the reason. All are skipped only where this machine
cannot build them (no g++, not Linux), which `kernels.cpu_build.supported` names."""
from __future__ import annotations

import platform

import pytest
import torch

import kernels
from kernels import cpu_build, linear
from tests.cpu_variants import BUILD_DIR
from tests.attention_cases import CASES, LONG, WINDOWS, close, make_batch, naive_attention

ok, why = cpu_build.supported()
pytestmark = pytest.mark.skipif(not ok, reason=f"C++ CPU kernels cannot be built here: {why}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (3, 3)])
def test_cpu_attention_matches_naive(isa, case, block_size, kv_heads, group):
    specs = CASES[case]
    query, kv, meta, fk, fv = make_batch(specs, block_size, kv_heads, group)
    out = kernels.paged_attention_cpu(query, kv[0, 0], kv[0, 1], meta, 0.3)
    close(out, naive_attention(query, fk, fv, specs, group, 0.3))


def test_cpu_attention_reads_fresh_keys_for_uncached_prefills(isa):
    """key/value given: prefill chunks without a cached prefix read them, not the cache."""
    specs = [(0, 9), (4, 1), (0, 5), (6, 3)]
    query, kv, meta, fk, fv = make_batch(specs, 8, 2, 3)
    key = torch.cat([k[p:] for k, (p, _) in zip(fk, specs)])
    value = torch.cat([v[p:] for v, (p, _) in zip(fv, specs)])
    expected = naive_attention(query, fk, fv, specs, 3, 0.3)
    for impl in (kernels.paged_attention_cpu, kernels.paged_attention_torch):
        close(impl(query, kv[0, 0], kv[0, 1], meta, 0.3, key, value), expected)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_prefill_kernel_matches_naive(isa, head_dim, dtype):
    """Prompt chunks with no cached prefix go to the C++ prefill kernel (head_dim 64, 128 or 256),
    the others to SDPA, decode rows to the decode kernel, all in one batch."""
    specs = [(0, 37), (5, 1), (0, 16), (0, 1), (9, 4), (0, 33), (0, 2)]
    query, kv, meta, fk, fv = make_batch(specs, 16, 3, 3, head_dim=head_dim, dtype=dtype)
    key = torch.cat([k[p:] for k, (p, _) in zip(fk, specs)])
    value = torch.cat([v[p:] for v, (p, _) in zip(fv, specs)])
    expected = naive_attention(query, fk, fv, specs, 3, head_dim ** -0.5)
    out = kernels.paged_attention_cpu(query, kv[0, 0], kv[0, 1], meta, head_dim ** -0.5, key, value)
    close(out, expected, dtype)
    direct = torch.zeros_like(query)  # the kernel alone, on the four fresh chunks
    spans = torch.tensor([(p.start, p.end) for p in meta.prefills if p.end - p.start == p.seq_len])
    assert spans.tolist() == [[0, 37], [38, 54], [59, 92], [92, 94]]
    cpu_build.ops().prefill_attention(direct, query, key, value, spans, head_dim ** -0.5)
    for a, b in spans.tolist():
        close(direct[a:b], expected[a:b], dtype)


@pytest.mark.parametrize("head_dim", [16, 64, 256])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_attention_in_a_sliding_window_matches_naive(isa, head_dim, block_size, window):
    """The decode kernel (head_dim 16: its portable loops), the prefill kernel on fresh chunks
    (given key/value) and SDPA on chunks with a cached prefix, each limited to the window; GQA 4 on
    one KV head as Gemma 3; NULL entries before every window, whose blocks are never read."""
    specs = LONG
    query, kv, meta, fk, fv = make_batch(specs, block_size, 1, 4, head_dim=head_dim, seed=window, window=window)
    key = torch.cat([k[p:] for k, (p, _) in zip(fk, specs)])
    value = torch.cat([v[p:] for v, (p, _) in zip(fv, specs)])
    expected = naive_attention(query, fk, fv, specs, 4, head_dim ** -0.5, window)
    for kv_new in ((None, None), (key, value)):
        close(kernels.paged_attention_cpu(query, kv[0, 0], kv[0, 1], meta, head_dim ** -0.5, *kv_new), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_decode_attention_reads_strided_queries(isa, dtype):
    """q as the engine passes it: a view of one fused q|k|v GEMM output, rows strided (head_dim
    16: the portable loops; 64 and 128 take the vector ones, tested above)."""
    specs = [(37, 1), (3, 1), (64, 1)]
    query, kv, meta, fk, fv = make_batch(specs, 16, 2, 3, dtype=dtype)
    fused = torch.randn(query.shape[0], query.shape[1] + 4, query.shape[2]).to(dtype)
    fused[:, :query.shape[1]] = query
    out = kernels.paged_attention_cpu(fused[:, :query.shape[1]], kv[0, 0], kv[0, 1], meta, 0.3)
    assert out.dtype == dtype
    close(out, naive_attention(query, fk, fv, specs, 3, 0.3), dtype)


@pytest.mark.parametrize("head_dim", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_gives_the_same_bits_on_any_number_of_threads(isa, head_dim, dtype):
    """Fewer (sequence, KV head) pairs than threads (Gemma 3 at batch 1: one KV head, four query
    heads) cut each pair's heads across the threads; a head's arithmetic stays its own."""
    specs = [(600, 1)]  # enough keys for a region of its own at head_dim 16 too
    query, kv, meta, fk, fv = make_batch(specs, 16, 1, 4, head_dim=head_dim, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append(kernels.paged_attention_cpu(query, kv[0, 0], kv[0, 1], meta, 0.3))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    close(outs[0], naive_attention(query, fk, fv, specs, 4, 0.3), dtype)


def qkv_views(T, H, KVH, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, H + 2 * KVH, D, generator=g).to(dtype)
    return qkv, qkv.split([H, KVH, KVH], dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_equals_the_torch_path_exactly(isa, dtype):
    T, H, KVH, D, bs = 37, 9, 3, 64, 16
    positions = torch.randint(0, 4000, (T,))
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = positions[:, None].float() * inv
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(8 * bs)[:T]
    slots[5] = -1  # a token not to store
    results = []
    for native in (True, False):
        qkv, (q, k, v) = qkv_views(T, H, KVH, D, dtype)
        cache = torch.zeros(2, 8, bs, KVH, D, dtype=dtype)
        if native:
            cpu_build.ops().rope_store(q, k, v, cos, sin, cache[0], cache[1], slots)
        else:
            kernels.rope_torch(q, k, cos, sin)
            kernels.store_kv_torch(k, v, cache[0], cache[1], slots)
        results.append((qkv, cache))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    stored = results[0][1][0].reshape(-1, KVH * D).abs().sum(1) != 0
    assert int(stored.sum()) == T - 1  # the -1 slot stored nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_dtype", [None, torch.float32], ids=["qwen3-norm", "gemma-norm"])
def test_rope_store_after_qk_norms_equals_the_torch_path(isa, dtype, norm_dtype):
    """q and k normalised per head first (Qwen3's weight in the dtype, Gemma's 1 + w in float32)."""
    T, H, KVH, D, bs = 21, 4, 1, 256, 8
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(T, D, generator=g)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_norm, k_norm = ((1 + 0.2 * torch.randn(D, generator=g)).to(norm_dtype or dtype) for _ in range(2))
    slots = torch.randperm(4 * bs)[:T]
    results = []
    for native in (True, False):
        qkv, (q, k, v) = qkv_views(T, H, KVH, D, dtype, seed=4)
        cache = torch.zeros(2, 4, bs, KVH, D, dtype=dtype)
        if native:
            cpu_build.ops().rope_store(q, k, v, cos, sin, cache[0], cache[1], slots, q_norm, k_norm, 1e-6)
        else:
            kernels.rope_torch(q, k, cos, sin, q_norm, k_norm, 1e-6)
            kernels.store_kv_torch(k, v, cache[0], cache[1], slots)
        results.append((qkv, cache))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(results[0][0], results[1][0], **tol)
    torch.testing.assert_close(results[0][1], results[1][1], **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 300])  # 300 rows: the multi-threaded path
def test_norms_and_silu_match_the_torch_path(isa, dtype, rows):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    res = torch.randn(rows, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    # one unit in the last place of the dtype: the sum of squares is summed in another order
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    out = torch.empty_like(x)
    cpu_build.ops().rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out, kernels.rms_norm_torch(x, w, 1e-5), **tol)
    xa, ra, xb, rb = x.clone(), res.clone(), x.clone(), res.clone()
    cpu_build.ops().add_rms_norm(xa, ra, w, 1e-5)
    kernels.add_rms_norm_torch(xb, rb, w, 1e-5)
    assert torch.equal(ra, rb)  # the residual add is one rounding on both paths
    torch.testing.assert_close(xa, xb, **tol)
    # Gemma: its weight 1 + w in float32 (one rounding after the product), the norm of the layer's
    # output first (`pre`); under float32 x the same products as the weight in x's dtype
    w32, pre = 1 + 0.1 * torch.randn(576, generator=g), 1 + 0.1 * torch.randn(576, generator=g)
    cpu_build.ops().rms_norm(out, x, w32, 1e-6)
    torch.testing.assert_close(out, kernels.rms_norm_torch(x, w32, 1e-6), **tol)
    expected = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w32).to(dtype)
    torch.testing.assert_close(out, expected, **tol)  # Gemma3RMSNorm's arithmetic
    xa, ra, xb, rb = x.clone(), res.clone(), x.clone(), res.clone()
    cpu_build.ops().add_rms_norm(xa, ra, w32, 1e-6, pre)
    kernels.add_rms_norm_torch(xb, rb, w32, 1e-6, pre)
    torch.testing.assert_close(ra, rb, **tol)
    torch.testing.assert_close(xa, xb, **tol)
    for inter in (1536, 1541):  # 1541: a tail after the last full vector
        gu = 4 * torch.randn(rows, 2 * inter, generator=g).to(dtype)
        for op, ref in (("silu_and_mul", kernels.silu_and_mul_torch),
                        ("gelu_tanh_and_mul", kernels.gelu_tanh_and_mul_torch)):
            act = torch.empty(rows, inter, dtype=dtype)
            getattr(cpu_build.ops(), op)(act, gu)
            torch.testing.assert_close(act, ref(gu), **tol)


def test_bad_input_is_refused_clearly(isa):
    q = torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="kvscope: rope_store takes float32, bfloat16 or float16"):
        cpu_build.ops().rope_store(q.double(), q[:, :1].double(), q[:, :1].double(), torch.ones(2, 8).double(),
                                     torch.ones(2, 8).double(), torch.zeros(1, 4, 1, 8).double(),
                                     torch.zeros(1, 4, 1, 8).double(), torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="kvscope: silu_and_mul wants out"):
        cpu_build.ops().silu_and_mul(torch.empty(2, 3), torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="must share a dtype"):
        cpu_build.ops().decode_attention(q, q.bfloat16(), torch.zeros(4, 4, 3, 8), torch.zeros(4, 4, 3, 8),
                                           torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                           torch.arange(2), 1.0)


def test_a_build_failure_falls_back_to_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setattr(cpu_build, "_libraries", {})
    monkeypatch.setattr(cpu_build, "FLAGS",
                        cpu_build.FLAGS + ["-fno-such-flag"])  # a new key: a fresh build, which fails
    said = []
    assert not cpu_build.load(tmp_path, said.append)
    assert "g++ failed" in cpu_build.status() and "using the torch path" in said[-1]
    assert not kernels._native(torch.zeros(1))


def test_linear_backend_is_checked_and_falls_back(monkeypatch):
    layers = [torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 32, bias=True)]
    fused = linear.Linear(layers, "torch")
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = torch.cat([layer(x) for layer in layers], dim=1)
        torch.testing.assert_close(fused(x), expected)
        torch.testing.assert_close(linear.Linear(layers, "onednn")(x), expected, atol=1e-5, rtol=1e-5)
    assert linear.choose_backend(layers)[0] in ("torch", "onednn")
    monkeypatch.setattr(linear, "_onednn_ops", lambda: False)
    monkeypatch.setattr(linear, "_choice", {})
    assert linear.choose_backend(layers)[0] == "torch"
    odd = [torch.nn.Linear(64, 40)]  # 40 outputs: not blocks of 16, so gemv refuses and is never chosen
    assert linear.choose_backend(odd) == ("torch", False)


@pytest.mark.parametrize("dtype,gemv_dtype",
                         [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)],
                         ids=["fp32", "bf16", "fp32+bf16"])
@pytest.mark.parametrize("layout", linear.GEMV_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_the_torch_linear(isa, dtype, gemv_dtype, layout, rows, bias):
    """kvscope.gemv (few rows, weights streamed once) = F.linear, through Linear as the engine calls it,
    in every layout, which all give the bits of rows (the same sums in the same order); on a bf16
    copy of the weights, = F.linear on those rounded weights in fp32 arithmetic."""
    torch.manual_seed(rows)
    layers = [torch.nn.Linear(576, 960, bias=bias).to(dtype), torch.nn.Linear(576, 64, bias=bias).to(dtype)]
    x = torch.randn(rows, 2 * 576, dtype=dtype)[:, :576]  # rows strided, as the engine's views are
    streamed = lambda w: w.to(gemv_dtype or dtype).double()
    with torch.inference_mode():
        lin = linear.Linear(layers, "torch", gemv=True, gemv_dtype=gemv_dtype)
        in_rows, operand = lin(x), lin.plain.clone()
        linear.relayout(lin, layout)
        out = lin(x)
        assert torch.equal(out, in_rows)
        linear.relayout(lin, "rows")  # and back, the operand as it was
        assert torch.equal(lin.plain, operand) and torch.equal(lin(x), in_rows)
        expected = torch.cat([torch.nn.functional.linear(x.double(), streamed(layer.weight),
                                                         None if layer.bias is None else layer.bias.double())
                              for layer in layers], dim=1)
    assert out.dtype == dtype and out.shape == (rows, 1024)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("dtype,gemv_dtype,fast", [
    (torch.bfloat16, None, "rows"), (torch.bfloat16, None, "serial"), (torch.bfloat16, None, "packed"),
    (torch.bfloat16, None, "off"), (torch.float32, None, "rows"), (torch.float32, None, "serial"),
    (torch.float32, None, "off"), (torch.float32, torch.bfloat16, "rows"), (torch.float32, torch.bfloat16, "serial"),
    (torch.float32, torch.bfloat16, "packed"), (torch.float32, torch.bfloat16, "off")],
    ids=lambda v: str(v).removeprefix("torch."))
def test_each_kind_of_layer_runs_its_few_rows_the_fastest_way(isa, monkeypatch, dtype, gemv_dtype, fast):
    """choose_gemv times the ways of a kind of layer (here on a clock that each real call advances
    by 1, or 2 for every way but `fast`: a sleep on the wall clock flaked on a loaded machine) and
    leaves the whole kind in the fastest; the layouts give the same outputs, the GEMM the same
    within rounding; weights streamed in their own dtype are not copied unless packed; a bf16
    copy of fp32 weights is streamed whatever the timing says (it is that mode)."""
    torch.manual_seed(0)
    lins = [linear.Linear([torch.nn.Linear(k, n, bias=False).to(dtype)], "torch", gemv=True, gemv_dtype=gemv_dtype)
            for n, k in [(96, 64), (48, 128), (96, 64)]]
    xs = [torch.randn(1, lin.in_features, dtype=dtype) for lin in lins]
    with torch.inference_mode():
        before = [lin(x) for lin, x in zip(lins, xs)]
        call, now = linear.Linear.__call__, [0.0]

        def timed(lin, x):
            now[0] += 1.0 if linear.gemv_way(lin) == fast else 2.0
            return call(lin, x)
        monkeypatch.setattr(linear, "perf_counter", lambda: now[0])
        monkeypatch.setattr(linear.Linear, "__call__", timed)
        chosen = linear.choose_gemv(lins)
        monkeypatch.undo()
        assert chosen == fast or (gemv_dtype and fast == "off" and chosen in linear.GEMV_LAYOUTS)
        assert [linear.gemv_way(lin) for lin in lins] == [chosen] * 3
        after = [lin(x) for lin, x in zip(lins, xs)]
    for a, b in zip(after, before):
        assert torch.equal(a, b) if chosen != "off" else torch.allclose(a, b, atol=1e-2, rtol=1e-2)
    if gemv_dtype is None and chosen != "packed":
        assert all(lin.plain.data_ptr() == lin.weight.data_ptr() for lin in lins)


@pytest.mark.parametrize("packed_cost,chosen", [(0.97, "rows"), (0.90, "packed")])
def test_packed_is_chosen_only_when_clearly_faster(isa, monkeypatch, packed_cost, chosen):
    """Packed is a copy, and within a few % of the rows the two flip between loads: it must be
    PACKED_MARGIN faster (a clock that each call advances by its way's cost, so no timing)."""
    lins = [linear.Linear([torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)], "torch", gemv=True)]
    cost, now = {"rows": 1.0, "serial": 1.0, "packed": packed_cost, "off": 2.0}, [0.0]
    monkeypatch.setattr(linear, "perf_counter", lambda: now[0])
    step = lambda lin, x: now.__setitem__(0, now[0] + cost[linear.gemv_way(lin)])  # noqa: E731
    monkeypatch.setattr(linear.Linear, "__call__", step)
    assert linear.choose_gemv(lins) == chosen


def test_gemv_refuses_what_it_cannot_do(isa):
    w = torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="M <= 4"):
        cpu_build.ops().gemv(torch.empty(5, 32), torch.randn(5, 64), w, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_build.ops().gemv(torch.empty(1, 24), torch.randn(1, 64), w[:24], None)
    with pytest.raises(RuntimeError, match="no kernel for Half"):
        cpu_build.ops().gemv(torch.empty(1, 32).half(), torch.randn(1, 64).half(), w.half(), None)
    with pytest.raises(RuntimeError, match="bfloat16 under float32"):  # bf16 x with fp32 weights: no
        cpu_build.ops().gemv(torch.empty(1, 32).bfloat16(), torch.randn(1, 64).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="packed weights under float32 x or bf16 x and weights"):
        cpu_build.ops().gemv(torch.empty(1, 32).half(), torch.randn(1, 64).half(), w.half(), None, 1)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        cpu_build.ops().gemv(torch.empty(1, 32), torch.randn(1, 48), torch.randn(32, 48), None, 1)
    with pytest.raises(RuntimeError, match="layout is 0 .rows., 1 .packed. or 2 .serial., not 3"):
        cpu_build.ops().gemv(torch.empty(1, 32), torch.randn(1, 64), w, None, 3)
    with pytest.raises(RuntimeError, match="gemv_pack wants"):
        cpu_build.ops().gemv_pack(w[:24])


@pytest.mark.parametrize("vocab", [1, 15, 49152, 262144 + 7])  # 49152 and 262144: SmolLM2's, Gemma 3's
def test_argmax_equals_torchs(isa, vocab):
    """The greedy token of each row, as torch.argmax: ties to the first (in one span and across
    spans), NaN above all, the first of two infinities, a row of -inf its first index, rows not
    contiguous (5 floats apart from their stride)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab + 5, generator=g)[:, 5:]
    top = logits.max() + 1
    at = lambda *xs: [x % vocab for x in xs]  # noqa: E731
    logits[0, at(40000, 16384 + 3, vocab - 1)] = top  # equal winners in three spans
    logits[1, at(16390, 7, 5)] = top  # two in one span, one in another
    logits[2, at(vocab - 2, 9)] = float("nan")  # the first NaN wins, past a larger value
    logits[2, at(3)] = top
    logits[3] = float("-inf")
    logits[4, at(vocab - 3, 11)] = float("inf")
    expected = logits.argmax(-1).tolist()
    assert cpu_build.ops().argmax(logits).tolist() == expected
    assert kernels.argmax(logits).tolist() == expected
    assert cpu_build.ops().argmax(logits[5:]).tolist() == expected[5:]  # one row: on one thread below 32k


def test_argmax_refuses_what_it_cannot_do(isa):
    with pytest.raises(RuntimeError, match="float32 logits"):
        cpu_build.ops().argmax(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="float32 logits"):
        cpu_build.ops().argmax(torch.randn(8))
    assert kernels.argmax(torch.randn(2, 8).bfloat16()).shape == (2,)  # torch's own, elsewhere
    columns = torch.randn(8, 3).t()  # its vocab not contiguous: torch's own too
    assert kernels.argmax(columns).tolist() == columns.argmax(-1).tolist()


@pytest.mark.parametrize("machine,flags,best", [
    ("x86_64", "flags : fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16", "avx512"),
    ("x86_64", "flags : fpu sse2 avx avx2 fma f16c", "avx2"),
    ("x86_64", "flags : fpu sse2 avx", "generic"),
    ("aarch64", "Features : fp asimd evtstrm aes crc32 atomics", "generic")])
def test_each_cpu_gets_the_best_variant_it_runs_and_a_forced_one_it_cannot_run_is_refused(
        monkeypatch, machine, flags, best):
    """The variant follows /proc/cpuinfo's flags (here: those of four kinds of CPU);
    KVSCOPE_CPU_ISA forces one, and one the CPU cannot run is a clear error, not a crash."""
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: flags)
    cpu_build._flag.cache_clear()
    try:
        monkeypatch.delenv("KVSCOPE_CPU_ISA", raising=False)
        assert cpu_build.chosen_isa() == best
        runs = cpu_build.runnable_isas()
        assert runs[0] == best and runs[-1] == "generic"
        for isa in cpu_build.ISAS:
            monkeypatch.setenv("KVSCOPE_CPU_ISA", isa)
            if isa in runs:
                assert cpu_build.chosen_isa() == isa
            else:
                with pytest.raises(cpu_build.IsaError,
                                   match=f"KVSCOPE_CPU_ISA={isa}: .*this CPU runs {', '.join(runs)}"):
                    cpu_build.chosen_isa()
        monkeypatch.setenv("KVSCOPE_CPU_ISA", "sse9")
        with pytest.raises(cpu_build.IsaError, match="unknown variant 'sse9'"):
            cpu_build.chosen_isa()
        flags_of = {isa: cpu_build.target_flags(isa) for isa in runs}
        assert "-mno-avx512f" in flags_of.get("avx2", ["-mno-avx512f"])
        assert ("-mcpu=native" in flags_of["generic"]) == (machine == "aarch64")
    finally:
        cpu_build._flag.cache_clear()


def test_the_variants_are_separate_libraries_loaded_side_by_side():
    """Each variant this CPU runs loads into its own op namespace in one process, and they
    compute the same GEMV (fp32; within rounding, as the sums are added in another order)."""
    runs = cpu_build.runnable_isas() if ok else []
    if not runs:
        pytest.skip(why)
    w, x = torch.randn(64, 128), torch.randn(2, 128)
    outs = {}
    for isa in runs:
        ns = cpu_build.load_variant(BUILD_DIR, isa)
        outs[isa] = torch.empty(2, 64)
        ns.gemv(outs[isa], x, w, None)
    assert len({cpu_build._libraries[isa] for isa in runs}) == len(runs)
    for isa in runs:
        torch.testing.assert_close(outs[isa], x @ w.T, atol=1e-4, rtol=1e-4)


def test_bf16_gemv_weights_are_streamed_wherever_the_gemv_takes_them(isa, monkeypatch):
    """A copy of the weights for the GEMV is that mode's point: no timing decides it, only
    whether the kernel takes the shapes (N in blocks of 16)."""
    monkeypatch.setattr(linear, "_choice", {})
    assert linear.choose_backend([torch.nn.Linear(576, 960)], gemv_dtype=torch.bfloat16)[1] is True
    assert linear.choose_backend([torch.nn.Linear(64, 40)], gemv_dtype=torch.bfloat16)[1] is False
