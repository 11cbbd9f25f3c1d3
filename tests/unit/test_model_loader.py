import json
import os
import subprocess
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from engine.model import model_loader as ml
from engine.model.model_loader import ModelLoadError, apply_chat_template, default_cache_dir, load_model

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CPU_DTYPE = torch.bfloat16 if ml.cpu_has_bf16() else torch.float32


@pytest.fixture(scope="module")
def tiny_cpu() -> ml.LoadedModel:
    """On the CPU whatever the machine has (conftest's `tiny` takes the default device): these
    tests compare with CPU loads and check the CPU defaults."""
    return load_model("tiny", device="cpu")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------- tiny
def test_tiny_dims(tiny_cpu: ml.LoadedModel) -> None:
    lm = load_model("tiny", device="cpu", progress=lambda _: None)  # its load time: bench/model_load.py
    c = lm.model.config
    assert isinstance(lm.model, LlamaForCausalLM) and not lm.model.training
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim) == (2, 96, 6, 2, 16)
    assert c.vocab_size == len(lm.tokenizer) == 49152
    assert lm.model.get_input_embeddings().weight[lm.eos_token_ids].abs().sum(-1).min() > 0  # no zeroed pad row
    assert c._attn_implementation == "sdpa"
    assert (lm.name, lm.device, lm.dtype) == ("tiny-llama", torch.device("cpu"), DEFAULT_CPU_DTYPE)
    assert next(lm.model.parameters()).dtype == DEFAULT_CPU_DTYPE


def test_tiny_gemma3_dims_and_layer_kinds() -> None:
    lm = load_model("tiny-gemma3", device="cpu", dtype="float32", progress=lambda _: None)
    c = lm.model.config
    assert isinstance(lm.model, Gemma3ForCausalLM) and lm.name == "tiny-gemma3" and not lm.model.training
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert shape == (3, 128, 4, 1, 64)
    assert lm.layer_kinds == [ml.TINY_GEMMA3_WINDOW, ml.TINY_GEMMA3_WINDOW, None] == [32, 32, None]
    assert c.vocab_size == len(lm.tokenizer) and lm.eos_token_ids == [2, 0]
    norms = [w for n, w in lm.model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 3 * 6 + 1 and all(w.abs().sum() > 0 for w in norms)  # random, not Gemma's zeros
    assert _same_weights(lm.model, load_model("tiny-gemma3", device="cpu", dtype="float32").model)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = lm.tokenizer(prompt, return_tensors="pt")
        out = lm.model.generate(**ids, max_new_tokens=40, do_sample=False)[0, ids.input_ids.shape[1]:]
        assert len(set(out.tolist())) >= 10


def test_tiny_deterministic_and_leaves_global_rng_alone(tiny_cpu: ml.LoadedModel) -> None:
    before = torch.get_rng_state()
    assert _same_weights(tiny_cpu.model, load_model("tiny", device="cpu").model)
    assert torch.equal(before, torch.get_rng_state())


def test_tiny_greedy_is_not_degenerate(tiny_cpu: ml.LoadedModel) -> None:
    ids = tiny_cpu.tokenizer("The capital of France is", return_tensors="pt")
    out = tiny_cpu.model.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids.input_ids.shape[1]:]
    assert len(set(out.tolist())) >= 8


def test_tokenizer_round_trip(tiny_cpu: ml.LoadedModel) -> None:
    tok = tiny_cpu.tokenizer
    for text in ["Hello, world!", "In 2018, 12,345 people paid €3.50 each.\n\tdef f(x): return x**2",
                 "naïve café 東京"]:
        ids = tok.encode(text)
        assert ids and ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS to plain text
        assert tok.decode(ids) == text


def test_eos_ids(tiny_cpu: ml.LoadedModel) -> None:
    tok = tiny_cpu.tokenizer
    assert tiny_cpu.eos_token_ids == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) == [2, 0]
    assert tiny_cpu.model.generation_config.eos_token_id == tiny_cpu.eos_token_ids


def test_chat_template(tiny_cpu: ml.LoadedModel) -> None:
    tok = tiny_cpu.tokenizer
    ids = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    prompt = tok.encode("<|im_start|>assistant\n")
    assert ids[-len(prompt):] == prompt  # ends with the generation prompt
    text = tok.decode(ids)
    assert "<|im_start|>system\nYou are a helpful AI assistant" in text  # SmolLM2's default system turn
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    own = apply_chat_template(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tok.decode(own) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                               "<|im_start|>assistant\n")


def test_chat_without_template_falls_back_to_plain_text() -> None:
    tok = load_model("tiny", device="cpu").tokenizer
    tok.chat_template = None
    assert apply_chat_template(tok,
                               [{"role": "user", "content": "a"},
                                {"role": "user", "content": "b"}]) == tok.encode("a\nb")


def test_default_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 where the CPU has AVX512-BF16 or AMX; elsewhere fp32 with bf16 GEMV weights; a dtype
    named is used throughout, so fp32 stays exact anywhere."""
    bf16, fp32 = torch.bfloat16, torch.float32
    for has, expected in ((True, (bf16, bf16)), (False, (fp32, bf16))):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: has)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert ml._resolve_dtype(None, torch.device("cpu")) == expected
        assert ml._resolve_dtype("float32", torch.device("cpu")) == (fp32, fp32)
    assert ml._resolve_dtype(None, torch.device("cuda", 0)) == (bf16, bf16)
    assert ml._resolve_dtype("fp32+bf16", torch.device("cpu")) == (fp32, bf16)
    for bad in ("bfloat16+float32", "float32+float16", "float32+bfloat16+bfloat16"):
        with pytest.raises(ModelLoadError, match=re.escape(repr(bad))):
            ml._resolve_dtype(bad, torch.device("cpu"))


def test_dtype_and_progress() -> None:
    lines: list[str] = []
    lm = load_model("tiny", device="cpu", dtype="bf16", progress=lines.append)
    assert lm.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert lines and lines[-1].startswith("loaded: tiny-llama on cpu in bfloat16 (") and lines[-1].endswith(" s)")
    assert load_model("tiny", device="cpu", dtype="float16").dtype == torch.float16
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        load_model("tiny", device="cpu", dtype="int8")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVSCOPE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "kvscope"


# ---------------------------------------------------------------------------- local folders
def test_local_folder_round_trip(tiny_cpu: ml.LoadedModel, tmp_path: Path) -> None:
    folder = tmp_path / "my-llama"
    tiny_cpu.model.save_pretrained(folder)
    tiny_cpu.tokenizer.save_pretrained(folder)
    lm = load_model(str(folder), device="cpu")
    assert lm.name == "my-llama" and lm.eos_token_ids == [2, 0]
    assert lm.model.config._attn_implementation == "sdpa" and not lm.model.training
    assert _same_weights(tiny_cpu.model, lm.model)


def _folder(tmp_path: Path, config: dict | None, weights: bool = True, tokenizer: bool = True) -> Path:
    tmp_path.mkdir(exist_ok=True)
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if weights:
        (tmp_path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "nope", r"neither a bundled model \(smollm2, gemma3, tiny, tiny-gemma3\) nor an existing folder"),
    (lambda p: _folder(p, None, weights=False, tokenizer=False),
     r"missing config.json, weights \(\*.safetensors or pytorch_model\*.bin\), a tokenizer"),
    (lambda p: _folder(p, {"model_type": "llama"}, weights=False), r"missing weights"),
    (lambda p: _folder(p, {"model_type": "gpt2"}),
     r"model_type 'gpt2' is not supported; .*full and sliding-window attention: "
     r"llama, mistral, qwen2, qwen3, gemma3_text"),
    (lambda p: _folder(p, {"model_type": "gemma3"}),
     r"model_type 'gemma3' is not supported \(Gemma 3's text model is gemma3_text\)"),
    (lambda p: _folder(p, {"model_type": "gemma3_text", "num_hidden_layers": 2,
                           "layer_types": ["chunked_attention", "full_attention"]}),
     r"layer type\(s\) chunked_attention are not supported; KVScope runs full_attention and sliding_attention layers"),
    (lambda p: _folder(p, {"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}),
     r"gemma3_text with attn_logit_softcapping is not supported"),
])
def test_bad_path_is_refused_clearly(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(make(tmp_path / "m")), device="cpu")


@pytest.mark.parametrize("config, kinds", [
    ({"model_type": "llama", "num_hidden_layers": 3}, [None] * 3),
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 4096}, [4096] * 2),
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": None}, [None] * 2),
    ({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 64,
      "max_window_layers": 2}, [None, None, 64, 64]),
    ({"model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": 64}, [None] * 2),  # use_sliding_window off
    ({"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 512}, [512] * 5 + [None, 512]),
])
def test_layer_kinds_follow_the_config(config: dict, kinds: list) -> None:
    from transformers import AutoConfig
    cfg = dict(config)
    assert ml.layer_kinds(AutoConfig.for_model(cfg.pop("model_type"), **cfg)) == kinds


def test_publish_keeps_the_first_finished_copy(tmp_path: Path) -> None:
    dest = tmp_path / "Model"
    for i in range(2):
        tmp = ml._temp_folder(dest)
        (tmp / "config.json").write_text(str(i))
        ml._publish(tmp, dest)
        assert not tmp.exists()
    assert (dest / "config.json").read_text() == "0"
    assert [p.name for p in tmp_path.iterdir()] == ["Model"]


# ---------------------------------------------------------------------------- the real SmolLM2
@pytest.mark.slow
def test_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = load_model("smollm2", device="cpu")  # converts into the user's cache on the first run
    c = lm.model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert (lm.name, lm.dtype, lm.eos_token_ids) == ("SmolLM2-135M-Instruct", DEFAULT_CPU_DTYPE, [2, 0])
    assert getattr(lm.model, "hf_quantizer", None) is None and c._attn_implementation == "sdpa"
    tok = lm.tokenizer
    ids = tok("The capital of France is", return_tensors="pt")
    out = lm.model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.input_ids.shape[1]:])
    chat = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = lm.model.generate(torch.tensor([chat]), max_new_tokens=24, do_sample=False)[0, len(chat):].tolist()
    assert "Paris" in tok.decode(out) and out[-1] in lm.eos_token_ids  # stops on <|im_end|>
    # a second load reads the cached safetensors and never touches the GGUF
    monkeypatch.setattr(ml, "_convert", lambda *a: pytest.fail("converted again"))
    again = load_model("smollm2", device="cpu")
    assert Path(again.model.name_or_path) == default_cache_dir() / "SmolLM2-135M-Instruct"
    assert _same_weights(lm.model, again.model)


@pytest.mark.slow
def test_gemma3(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gemma 3 270M packages' GGUF, converted once like SmolLM2's: its layer kinds, EOS ids and
    the continuation transformers gives; a folder vLLM can read (no quantization_config); the
    assembled GGUF is not left behind."""
    lm = load_model("gemma3", device="cpu", dtype="float32")
    c, dest = lm.model.config, default_cache_dir() / "gemma-3-270m"
    assert isinstance(lm.model, Gemma3ForCausalLM) and Path(lm.model.name_or_path) == dest
    shape = (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)
    assert shape == (18, 4, 1, 256, 262144)
    assert lm.layer_kinds == ([512] * 5 + [None]) * 3
    assert lm.eos_token_ids == lm.tokenizer.convert_tokens_to_ids(["<eos>", "<end_of_turn>"]) == [1, 106]
    chat = apply_chat_template(lm.tokenizer, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi"}])
    assert lm.tokenizer.decode(chat) == ("<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>user\nHi"
                                         "<end_of_turn>\n<start_of_turn>model\n")  # the GGUF has none: ours
    assert chat.count(lm.tokenizer.bos_token_id) == 1 and 106 in chat  # <end_of_turn>: special tokens, not text
    assert "quantization_config" not in json.loads((dest / "config.json").read_text())
    # the assembled GGUF is in neither the model's folders nor a conversion's scratch folder (the
    # cache may hold other GGUFs: bench/llamacpp.py's llama.cpp and its F32/BF16 conversions)
    assert not [g for d in (dest, dest.with_name(f"{dest.name}-tokenizer")) for g in d.rglob("*.gguf")]
    assert not list(default_cache_dir().glob(f".{dest.name}*.tmp-*"))
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")
    out = lm.model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids.input_ids.shape[1]:]
    assert lm.tokenizer.decode(out) == " the capital of the country of France. It is the largest"
    monkeypatch.setattr(ml, "_convert", lambda *a: pytest.fail("converted again"))
    assert Path(load_model("gemma3", device="cpu").model.name_or_path) == dest


@pytest.mark.slow
def test_two_processes_convert_into_a_fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "KVSCOPE_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    code = "from engine.model.model_loader import load_model; print(load_model('smollm2', device='cpu').name)"
    logs = [(tmp_path / f"out{i}", tmp_path / f"err{i}") for i in range(2)]
    procs = []
    for out, err in logs:  # files, not pipes: the two run at once and neither may block on a full pipe
        with out.open("w") as o, err.open("w") as e:
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=o, stderr=e))
    for proc, (out, err) in zip(procs, logs):
        assert proc.wait(timeout=600) == 0, err.read_text()
        assert out.read_text().strip() == "SmolLM2-135M-Instruct"
        assert "de-quantizing weights" in err.read_text() and "loaded: SmolLM2-135M-Instruct" in err.read_text()
    dest = cache / "SmolLM2-135M-Instruct"
    assert sorted(p.name for p in cache.iterdir()) == ["SmolLM2-135M-Instruct"]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja"} <= {p.name for p in dest.iterdir()}
    assert "quantization_config" not in json.loads((dest / "config.json").read_text())
    monkeypatch.setenv("KVSCOPE_CACHE", str(cache))
    monkeypatch.setattr(ml, "_convert", lambda *a: pytest.fail("converted again"))
    lines: list[str] = []
    lm = load_model("smollm2", device="cpu", progress=lines.append)
    assert lines[0].startswith(f"loading SmolLM2-135M-Instruct from {dest} (")
    assert Path(lm.model.name_or_path) == dest
