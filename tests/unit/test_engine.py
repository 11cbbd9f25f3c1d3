"""The paged engine against transformers, and its events against the reducer."""
from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import replace

import pytest
import torch

import kernels
from engine.model import model_runner
from kvscope_contract import protocol as p
from engine.config import EngineConfig
from engine.model.engine import LLMEngine
from engine.model.model_loader import apply_chat_template, load_model
from engine.core.sequence import SamplingParams
from kvscope_contract.invariants import check_invariants
from kvscope_contract.state import PoolState
from tests.tiny_engine import hf_greedy, make

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Paged attention stores the keys and values of every token in fixed-size blocks, so that",
    "Q:",
]


def run_with_events(engine: LLMEngine, prompts, params: SamplingParams):
    first = engine.snapshot()
    outs = engine.generate(prompts, params)
    events = engine.log.drain()
    state = PoolState.from_snapshot(first)
    for ev in events:
        state.apply(ev)
    check_invariants(state)
    assert state.snapshot() == engine.snapshot()
    return outs, events


def run_to_end(engine: LLMEngine) -> list:
    """Step until every request is done; the outputs in the order they finished."""
    finished = []
    while engine.has_unfinished():
        finished += engine.step().finished
    return finished


def token_ids(outs) -> list[list[int]]:
    return [o.token_ids for group in outs for o in group]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_greedy_matches_transformers_generate(tiny, isa):
    engine = make(tiny)
    outs, events = run_with_events(engine, PROMPTS, GREEDY)
    appends = [e for e in events if isinstance(e, p.Append)]
    assert len(appends) == len(PROMPTS) * GREEDY.max_tokens  # one per sampled token, no more
    assert all(len(e.token_ids) == 1 for e in appends)
    for prompt, (out,) in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(tiny, out.prompt_token_ids, GREEDY.max_tokens), prompt
        assert out.finish_reason == "length"


def test_every_cpu_path_gives_the_same_tokens(tiny, isa, monkeypatch):
    """The engine as it chooses (C++ kernels of variant `isa`, packed oneDNN GEMMs when faster),
    the C++ GEMV on every decode step, and the plain torch path (no C++ kernels, F.linear): the
    same greedy tokens, so each equals transformers' as the test above shows."""
    def run(prompts, backend=None) -> list[list[int]]:
        if backend:
            monkeypatch.setattr(model_runner, "_PREPARED", weakref.WeakKeyDictionary())
            monkeypatch.setattr(model_runner, "choose_backend", lambda layers, **_: backend)
        return token_ids(run_with_events(make(tiny), prompts, GREEDY)[0])

    chosen = run(PROMPTS)
    gemv = run(PROMPTS[:3], ("torch", True))  # decode at 3 rows
    monkeypatch.setattr(kernels.cpu_build, "_state", {"loaded": False, "why": "this test"})
    plain = run(PROMPTS, ("torch", False))
    assert chosen == plain
    assert gemv == plain[:3]


def test_prefix_caching_on_and_off_give_identical_outputs(tiny):
    system = "You are a helpful assistant who answers briefly and precisely. " * 3
    prompts = [system + q for q in ("Why is the sky blue?", "Name a prime.", "Hello!")]
    on, on_events = run_with_events(make(tiny, block_size=8), prompts * 2, GREEDY)
    off, off_events = run_with_events(make(tiny, block_size=8, enable_prefix_caching=False),
                                      prompts * 2, GREEDY)
    assert token_ids(on) == token_ids(off)
    assert Counter(e.__struct_config__.tag for e in on_events)["prefix_hit"] > 0
    assert not any(isinstance(e, (p.PrefixHit, p.Cached)) for e in off_events)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_tiny_pool_forces_preemption_without_changing_outputs(tiny, mode):
    roomy, _ = run_with_events(make(tiny, block_size=4), PROMPTS, GREEDY)
    tight, events = run_with_events(
        make(tiny, block_size=4, num_device_blocks=24, num_host_blocks=48, preemption_mode=mode),
        PROMPTS, GREEDY)
    assert token_ids(tight) == token_ids(roomy)
    preempts = [e for e in events if isinstance(e, p.Preempt)]
    assert preempts and {e.mode for e in preempts} == {mode}
    if mode == "swap":
        kinds = Counter(e.__struct_config__.tag for e in events)
        assert kinds["swap_out"] == kinds["swap_in"] == len(preempts)


def test_chunked_prefill_gives_identical_outputs(tiny):
    whole, _ = run_with_events(make(tiny), PROMPTS, GREEDY)
    chunked, events = run_with_events(make(tiny, max_num_batched_tokens=8, max_num_seqs=8),
                                      PROMPTS, GREEDY)
    assert token_ids(chunked) == token_ids(whole)
    assert any(isinstance(e, p.Append) and not e.token_ids for e in events)  # a mid-prompt chunk


def test_parallel_sampling_shares_the_prompt_and_copies_the_partial_block_on_write(tiny):
    engine = make(tiny, block_size=8)
    params = SamplingParams(max_tokens=6, n=4, temperature=1.0, seed=7, ignore_eos=True)
    prompt = list(range(1000, 1020))  # 20 tokens: two full blocks and a partial one
    engine.add_request(prompt, params, request_id="fam")
    engine.step()  # the prefill, then the fork
    seqs = list(engine.seqs.values())
    assert [s.seq_id for s in seqs] == ["fam", "fam.1", "fam.2", "fam.3"]
    table = list(seqs[0].block_table)
    assert all(s.block_table == table for s in seqs)
    assert [engine.block_manager.pool.ref_counts[b] for b in table] == [4, 4, 4]
    finished = run_to_end(engine)
    events = engine.log.drain()
    cows = [e for e in events if isinstance(e, p.Cow)]
    assert len(cows) == 3 and {(c.logical_index, c.src_block_id) for c in cows} == {(2, table[2])}
    first = sorted(o.token_ids for o in finished)
    again = make(tiny, block_size=8)
    again.add_request(prompt, params)
    assert sorted(o.token_ids for o in run_to_end(again)) == first
    assert len({tuple(t) for t in first}) > 1  # the samples differ


def test_samples_yet_to_fork_count_against_max_num_seqs(tiny):
    engine = make(tiny, max_num_seqs=3)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1, ignore_eos=True))
    for prompt in PROMPTS[1:4]:
        engine.add_request(prompt, params)
    finished = run_to_end(engine)
    steps = [e for e in engine.log.drain() if isinstance(e, p.StepDone)]
    assert max(s.num_running for s in steps) == 3 and len(finished) == 5
    assert (steps[0].num_running, steps[0].num_waiting) == (3, 2)  # r1 and the child it forks, r2


def test_abort_and_finish_free_every_block(tiny):
    engine = make(tiny)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=3, ignore_eos=True))
    finished = [out for _ in range(5) for out in engine.step().finished]
    aborted = engine.abort("a")
    assert [o.finish_reason for o in aborted] == ["abort"] and engine.abort("nobody") == []
    finished += run_to_end(engine)
    assert sum(engine.block_manager.pool.ref_counts) == 0 and not engine.seqs
    assert [o.finish_reason for o in finished] == ["length"]


def test_a_request_id_that_collides_with_a_samples_id_is_refused_either_way(tiny):
    """Samples of a request are named REQUEST.1, ...: a request named like one (before or after
    the fork) is refused, and so is a request whose samples would take a running request's id;
    the stream never holds two sequences of one id."""
    engine = make(tiny, num_device_blocks=64)
    fam = engine.add_request("hi there", SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=1,
                                                        ignore_eos=True), request_id="fam")
    assert fam == ["fam", "fam.1", "fam.2"]
    engine.add_request("alone", SamplingParams(max_tokens=20, ignore_eos=True), request_id="solo.1")
    for forked in (False, True):  # before the fork (the samples are only promised), then after
        for rid, n in (("fam.2", 1), ("solo", 2)):
            with pytest.raises(p.CommandError) as e:
                engine.add_request("x", SamplingParams(max_tokens=2, n=n, temperature=1.0), request_id=rid)
            assert e.value.code == "duplicate_id" and "sample" in e.value.message, (rid, forked)
        engine.step()
    assert {"fam.1", "fam.2", "solo.1"} <= set(engine.seqs)
    assert engine.add_request("x", SamplingParams(max_tokens=2), request_id="fam.3") == ["fam.3"]  # not a sample
    run_to_end(engine)
    assert engine.add_request("x", SamplingParams(max_tokens=2, n=2), request_id="solo") == ["solo", "solo.1"]


def test_requests_that_can_never_fit_are_refused(tiny):
    engine = make(tiny, block_size=4, num_device_blocks=8)
    with pytest.raises(p.CommandError) as e:
        engine.add_request("word " * 40, SamplingParams(max_tokens=4))
    assert e.value.code == "too_long" and "blocks of 4" in e.value.message
    engine.add_request("hi", SamplingParams(max_tokens=4), request_id="x")
    with pytest.raises(p.CommandError) as e:
        engine.add_request("hi", request_id="x")
    assert e.value.code == "duplicate_id"


def test_chat_messages_go_through_the_chat_template(tiny):
    engine = make(tiny)
    engine.add_request(messages=[{"role": "user", "content": "Hi"}],
                       params=SamplingParams(max_tokens=4, ignore_eos=True))
    (out,) = run_to_end(engine)
    assert out.prompt_token_ids == apply_chat_template(tiny.tokenizer, [{"role": "user", "content": "Hi"}])
    assert len(out.prompt_token_ids) > 3 and len(out.token_ids) == 4


def test_an_eos_token_ends_the_sequence_with_reason_stop(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    greedy = hf_greedy(tiny, ids, 12)
    eos = greedy[5]  # the random tiny model never says its real EOS: make its 6th token one
    ends = greedy[:greedy.index(eos) + 1]
    engine = make(replace(tiny, eos_token_ids=[eos]))
    (out,), = engine.generate([ids], SamplingParams(max_tokens=12))
    assert out.finish_reason == "stop" and out.token_ids == ends and len(ends) < 12
    finish = [e for e in engine.log.drain() if isinstance(e, p.Finish)]
    assert [(e.seq_id, e.reason) for e in finish] == [(out.seq_id, "stop")]
    (out,), = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.finish_reason == "length" and out.token_ids == greedy


def test_top_p_samples_only_from_the_nucleus(tiny):
    """top_p so small that only the most likely token is left gives greedy output at any
    temperature; top_p 1 with the same seed does not."""
    ids = tiny.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    greedy = hf_greedy(tiny, ids, 16)
    engine = make(tiny)
    hot = SamplingParams(max_tokens=16, temperature=2.0, seed=3, ignore_eos=True)
    (a,), (b,) = engine.generate([ids, ids], replace(hot, top_p=1e-6))
    (full,), = engine.generate([ids], hot)
    assert a.token_ids == b.token_ids == greedy and full.token_ids != greedy


def test_reset_keeps_the_model_and_rebuilds_the_pools(tiny):
    engine = make(tiny)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8))
    engine.step()
    engine.reset(p.PoolConfig(block_size=32, num_device_blocks=16, num_host_blocks=0))
    snap = engine.snapshot()
    assert snap.config.block_size == 32 and len(snap.device_blocks) == 16 and not snap.seqs
    assert snap.config.bytes_per_block == engine.runner.bytes_per_block(snap.config)
    engine.runner.memory_fraction = 1e-4
    with pytest.raises(p.CommandError, match="GiB"):
        engine.reset(p.PoolConfig(block_size=256, num_device_blocks=65536))
    assert engine.pool.block_size == 32  # a refused reset changes nothing
    (out,), = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", dtype="float32")


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_generate(smollm2, isa):
    loaded = smollm2
    engine = LLMEngine(EngineConfig(pool=p.PoolConfig(num_device_blocks=256)), loaded)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs, _ = run_with_events(engine, PROMPTS[:4], params)  # decode at 4 rows: the C++ GEMV where chosen
    for (out,) in outs:
        assert out.token_ids == hf_greedy(loaded, out.prompt_token_ids, params.max_tokens)
    assert "Paris" in outs[0][0].text
    engine.add_request(messages=[{"role": "user", "content": "Say hello."}], params=SamplingParams(max_tokens=64))
    (out,) = run_to_end(engine)  # the real model ends its answer with its EOS token
    assert out.finish_reason == "stop" and out.token_ids[-1] in loaded.eos_token_ids and len(out.token_ids) < 64


@pytest.mark.slow
def test_smollm2_bf16_engine_stays_close_to_fp32_transformers(smollm2, isa):
    """bf16 (the default on CPUs with AVX512-BF16 or AMX; on the other variants bf16 weights are
    widened to fp32 in the kernels) against the fp32 reference: the same next token after each
    prompt, and logits within bf16's precision."""
    bf16, ref = load_model("smollm2", dtype="bfloat16"), smollm2
    engine = LLMEngine(EngineConfig(pool=p.PoolConfig(num_device_blocks=256)), bf16)
    for prompt in PROMPTS[:5]:
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        batch = engine.scheduler.schedule()
        logits = engine.runner.execute(batch)[0]
        engine.abort(batch.rows[0].seq.request_id)
        with torch.inference_mode():
            expected = ref.model(torch.tensor([ids])).logits[0, -1].float()
        assert logits.argmax() == expected.argmax(), prompt
        assert torch.nn.functional.cosine_similarity(logits, expected, dim=0) > 0.995, prompt


@pytest.mark.slow
def test_smollm2_with_bf16_gemv_weights_follows_fp32_transformers(smollm2, isa):
    """float32+bfloat16 (the default on CPUs without bf16 products): prefill runs the fp32 GEMMs,
    decode at 1-4 rows streams bf16-rounded weights with fp32 arithmetic. Teacher-forced through
    the fp32 reference, every token it generated is the reference's first choice or a near-tie."""
    mixed, ref = load_model("smollm2", dtype="float32+bfloat16"), smollm2
    assert (mixed.dtype, mixed.gemv_dtype) == (torch.float32, torch.bfloat16)
    engine = LLMEngine(EngineConfig(pool=p.PoolConfig(num_device_blocks=256)), mixed)
    assert engine.runner.info().gemv_dtype == "bfloat16"
    linears = [engine.runner.lm_head] + [lin for w in engine.runner.layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
    assert all(lin.gemv and lin.plain.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32 for lin in linears)
    outs = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=12, ignore_eos=True))
    gaps = []
    for (out,) in outs:
        ids = out.prompt_token_ids + out.token_ids
        with torch.inference_mode():
            logits = ref.model(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1].float()
        gaps += (logits.max(dim=1).values - logits[torch.arange(len(out.token_ids)), out.token_ids]).tolist()
    print("reference logit below its first choice, per token:", [round(g, 3) for g in gaps])
    assert max(gaps) < 0.1 and sum(g == 0 for g in gaps) >= 0.9 * len(gaps)


# ---------------------------------------------------------------------------- Gemma 3: sliding windows
# Longer than tiny-gemma3's window of 32 tokens in its prompt alone (54 tokens).
LONG_PROMPT = ("Paged attention stores the keys and values of every token in fixed-size blocks that can live "
               "anywhere in one pool; a block table maps each sequence's logical blocks to physical ones, and "
               "a sliding-window layer only ever reads the blocks of its last few tokens.")


def torch_path(monkeypatch) -> None:
    """Engines made from here on run the plain torch path: no C++ kernels, F.linear."""
    monkeypatch.setattr(model_runner, "_PREPARED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(model_runner, "choose_backend", lambda layers, **_: ("torch", False))
    monkeypatch.setattr(kernels.cpu_build, "_state", {"loaded": False, "why": "this test"})


@pytest.fixture(scope="module")
def tiny_gemma3():
    return load_model("tiny-gemma3", dtype="float32")


def assert_greedy_matches_transformers(loaded, outs, max_new: int) -> None:
    for (out,) in outs:
        assert out.token_ids == hf_greedy(loaded, out.prompt_token_ids, max_new), out.prompt_token_ids[:8]


@pytest.mark.parametrize("block_size", [8, 16])
def test_tiny_gemma3_greedy_matches_transformers_on_every_cpu_path(tiny_gemma3, isa, block_size, monkeypatch):
    """Gemma 3's layers (sandwich norms, GELU-tanh, q/k norms, two RoPE bases, a window of 32 on two
    of its three layers) through the paged engine on a hybrid pool (a KV group per layer here, the
    sliding groups' blocks freed as the window moves): the C++ kernels of variant `isa`, prefill in
    chunks of 16 (a cached prefix longer than the window), then the plain torch path."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = PROMPTS + [LONG_PROMPT]
    assert len(tiny_gemma3.tokenizer.encode(LONG_PROMPT)) > 32
    engine = make(tiny_gemma3, block_size=block_size)
    assert [(g.kind, g.layers) for g in engine.pool.kv_groups] == [
        ("sliding_window", [0]), ("sliding_window", [1]), ("full_attention", [2])]
    assert engine.runner.kv_cache.shape[0] == 1  # one layer per group
    outs, events = run_with_events(engine, prompts, params)
    assert any(isinstance(e, p.WindowFree) for e in events)  # blocks left the window: NULL entries
    assert_greedy_matches_transformers(tiny_gemma3, outs, params.max_tokens)
    chunked, _ = run_with_events(make(tiny_gemma3, block_size=block_size, max_num_batched_tokens=16), prompts, params)
    assert token_ids(chunked) == token_ids(outs)
    torch_path(monkeypatch)
    plain, _ = run_with_events(make(tiny_gemma3, block_size=block_size), prompts, params)
    assert token_ids(plain) == token_ids(outs)


def test_a_window_smaller_than_a_block_is_refused_and_the_engine_keeps_its_pool(tiny_gemma3):
    engine = make(tiny_gemma3, block_size=16)
    with pytest.raises(p.CommandError, match="sliding window of 32 tokens, smaller than a block of 64"):
        engine.reset(p.PoolConfig(block_size=64, num_device_blocks=64))
    assert engine.pool.block_size == engine.runner.block_size == 16
    (out,), = engine.generate([LONG_PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3", dtype="float32")


def gemma3_engine(loaded, max_num_batched_tokens: int = 1024, **pool) -> LLMEngine:
    return LLMEngine(EngineConfig(model="gemma3", max_num_batched_tokens=max_num_batched_tokens,
                                  pool=p.PoolConfig(**{"num_device_blocks": 256, "num_host_blocks": 0, **pool})),
                     loaded)


def test_gemma3_greedy_matches_transformers_generate(gemma3, monkeypatch):
    """The real Gemma 3 270M in fp32, prompts shorter than its window of 512: token-identical to
    transformers on the C++ kernels (decode at 4 rows: the GEMV where chosen) and on the torch path."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = gemma3_engine(gemma3)
    prompts = [engine.tokenize(x) for x in PROMPTS[:4]]
    assert all(ids[0] == gemma3.tokenizer.bos_token_id for ids in prompts)
    outs, _ = run_with_events(engine, prompts, params)
    assert outs[0][0].text.startswith(" the capital of the country of France")
    assert_greedy_matches_transformers(gemma3, outs, params.max_tokens)
    torch_path(monkeypatch)
    assert token_ids(run_with_events(gemma3_engine(gemma3), prompts, params)[0]) == token_ids(outs)


@pytest.mark.slow
def test_gemma3_long_prompt_slides_the_window_and_matches_transformers(gemma3, monkeypatch):
    """A prompt of over 1,000 tokens (twice the window), prefilled in chunks of 256 with
    64 tokens generated, beside a short one: every sliding layer attends only its last 512 tokens."""
    engine = gemma3_engine(gemma3, 256, num_device_blocks=1024)  # chunks: prefixes longer than the window
    long = engine.tokenize(" ".join([LONG_PROMPT] * 24))
    assert len(long) > 1000
    prompts, params = [long, engine.tokenize(PROMPTS[2])], SamplingParams(max_tokens=64, ignore_eos=True)
    outs, _ = run_with_events(engine, prompts, params)
    assert_greedy_matches_transformers(gemma3, outs, params.max_tokens)
    torch_path(monkeypatch)
    plain = gemma3_engine(gemma3, 256, num_device_blocks=1024)
    assert token_ids(run_with_events(plain, prompts, params)[0]) == token_ids(outs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32+bfloat16"])
def test_gemma3_in_the_cpus_default_dtypes_follows_fp32_transformers(gemma3, dtype):
    """bf16 (the default on CPUs with bf16 products) and float32+bfloat16 (elsewhere; force it with
    --dtype on any CPU): teacher-forced through the fp32 reference, every token generated is its
    first choice or a near-tie."""
    loaded = load_model("gemma3", dtype=dtype)
    engine = gemma3_engine(loaded)
    outs = engine.generate([engine.tokenize(x) for x in PROMPTS[:4]], SamplingParams(max_tokens=12, ignore_eos=True))
    gaps = []
    for (out,) in outs:
        ids = out.prompt_token_ids + out.token_ids
        with torch.inference_mode():
            logits = gemma3.model(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1].float()
        gaps += (logits.max(dim=1).values - logits[torch.arange(len(out.token_ids)), out.token_ids]).tolist()
    print(f"{dtype}: reference logit below its first choice, per token:", [round(g, 3) for g in gaps])
    assert max(gaps) < 0.5 and sum(g == 0 for g in gaps) >= 0.9 * len(gaps)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_sliding_window_families_match_transformers(tiny, family, tmp_path):
    """The sliding-window variants the loader accepts besides Gemma 3, as random 3-layer models in
    a local folder: Mistral (every layer in a window of 16 tokens) and Qwen2 (use_sliding_window:
    its layers from max_window_layers on), against transformers on prompts longer than the window."""
    from transformers import AutoConfig, AutoModelForCausalLM
    common = dict(vocab_size=len(tiny.tokenizer), hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  sliding_window=16, initializer_range=0.2, tie_word_embeddings=True,
                  eos_token_id=tiny.tokenizer.eos_token_id, bos_token_id=tiny.tokenizer.bos_token_id)
    extra = {"mistral": {}, "qwen2": dict(use_sliding_window=True, max_window_layers=1)}[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **common, **extra))
    model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.layer_kinds == {"mistral": [16] * 3, "qwen2": [None, 16, 16]}[family]
    engine = make(loaded, block_size=8)
    outs, events = run_with_events(engine, [PROMPTS[4], LONG_PROMPT], GREEDY)
    assert any(isinstance(e, p.WindowFree) for e in events)
    assert_greedy_matches_transformers(loaded, outs, GREEDY.max_tokens)
