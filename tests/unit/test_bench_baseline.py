"""bench/baseline.py: a git revision's C++ kernels load beside today's (the A/B of a kernel
change in bench.gemv and bench.cpu_variants), in their own op namespace, and compute."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from bench import baseline
from kernels import cpu_build

ok, why = cpu_build.supported()
in_git = shutil.which("git") is not None and subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=baseline.ROOT, capture_output=True).returncode == 0
pytestmark = [pytest.mark.skipif(not ok, reason=f"C++ CPU kernels cannot be built here: {why}"),
              pytest.mark.skipif(not in_git, reason="not a git checkout: no revision to build")]


@pytest.mark.slow  # a g++ build of the revision's kernels (~30 s on 2 cores)
def test_a_revisions_kernels_load_beside_todays_and_compute_the_same_gemv():
    isa = "generic"  # every CPU runs it
    today = cpu_build.load_variant(baseline.BUILD_DIR, isa)
    name = baseline.load(isa, "HEAD")
    assert name == "at_HEAD_generic" and baseline.load(isa, "HEAD") == name  # loaded once
    then = getattr(torch.ops, f"kvscope_{name}")
    torch.manual_seed(0)
    x, w = torch.randn(1, 576), torch.randn(960, 576)
    out_today, out_then = torch.empty(1, 960), torch.empty(1, 960)
    today.gemv(out_today, x, w, None)
    then.gemv(out_then, x, w, None)
    torch.testing.assert_close(out_then, out_today, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_today, x @ w.T, atol=1e-4, rtol=1e-4)


def test_an_unknown_revision_is_refused():
    with pytest.raises(ValueError, match="no kernels at git revision 'no-such-revision-anywhere'"):
        baseline.load("generic", "no-such-revision-anywhere")
