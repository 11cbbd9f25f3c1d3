"""What the plugin needs of the installed vLLM, checked against its real classes (in its own
virtualenv, no server): every method the observer wraps is there, a vLLM lacking one is refused by
name before anything is wrapped, and the launcher finds vLLM's OpenAI server where this release
keeps it. Run on each release `make test-vllm` / `make test-vllm-smoke` is given."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm.vllm_server import NO_VLLM, ROOT, VLLM_PYTHON, vllm_version

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.vllm_smoke,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM)]

PROBE = """
import json
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from integrations.vllm.observer import UnsupportedEngine, check_hooks, missing_hooks
from integrations.vllm.serve import api_server_module

real = {"Scheduler": Scheduler, "KVCacheManager": KVCacheManager, "BlockPool": BlockPool,
        "SingleTypeKVCacheManager": SingleTypeKVCacheManager}
renamed = dict(real, Scheduler=type("Scheduler", (Scheduler,), {"_preempt_request": None}),
               BlockPool=type("BlockPool", (BlockPool,), {"cache_full_blocks": None}))
try:
    check_hooks(renamed)
    refused = None
except UnsupportedEngine as e:
    refused = str(e)
print(json.dumps({"missing": missing_hooks(real), "refused": refused, "server": api_server_module()}))
"""


def test_the_installed_vllm_has_every_hook_and_a_missing_one_is_named():
    out = subprocess.run([str(VLLM_PYTHON), "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["missing"] == []
    version = vllm_version()
    assert probe["refused"] == (f"vLLM {version} has no Scheduler._preempt_request, BlockPool.cache_full_blocks, "
                                "which the plugin wraps to see its pool (it was tested on vLLM 0.27.1 to 0.32.0); "
                                "vLLM runs on, unobserved")
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    assert probe["server"] == ("vllm.entrypoints.launchers.api_server.entry" if major_minor >= (0, 32)
                               else "vllm.entrypoints.openai.api_server")
