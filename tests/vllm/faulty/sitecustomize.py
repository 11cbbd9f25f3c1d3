"""Fault injection for tests/vllm/test_vllm_plugin_safety.py, on PYTHONPATH of one vLLM only: with
KVSCOPE_TEST_FAIL_AFTER=N, the observer's N-th `_progress` hook raises (as a bug in it would),
inside the real vLLM's engine step. Nothing else changes; without the variable this does nothing."""
import importlib.abc
import importlib.util
import itertools
import os
import sys

TARGET = "integrations.vllm.observer"


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            calls, fail_at, progress = itertools.count(1), int(os.environ["KVSCOPE_TEST_FAIL_AFTER"]), \
                module.PoolObserver._progress

            def _progress(self, req):
                if next(calls) == fail_at:
                    raise RuntimeError("injected by the test: a hook that fails")
                return progress(self, req)
            module.PoolObserver._progress = _progress
        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("KVSCOPE_TEST_FAIL_AFTER"):
    sys.meta_path.insert(0, _Patch())
