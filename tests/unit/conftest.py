"""Fixtures of the unit tests."""
from __future__ import annotations

import pytest


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "isa" in metafunc.fixturenames:  # torch and the kernels load only for the tests that ask
        from tests.cpu_variants import isa_params
        metafunc.parametrize("isa", isa_params(), indirect=True, scope="module")


@pytest.fixture(scope="module")
def isa(request):
    """Every kernel call goes to this variant (its own library and op namespace) while the
    module's tests that ask for it run; the engine's own choice again after."""
    from kernels import cpu_build
    from tests.cpu_variants import BUILD_DIR
    saved = dict(cpu_build._state)
    cpu_build.use(request.param, BUILD_DIR)
    yield request.param
    cpu_build._state.clear()
    cpu_build._state.update(saved)
