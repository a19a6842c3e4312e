"""Every native kernel builds wherever a C++ compiler is present.

The kernel tests skip when their kernel is not available (a machine without a compiler falls
back to the eager references, by design), so a source that stops compiling would turn them
into skips, not failures. This test makes it a failure: on a machine with ``g++`` (CI has it),
each kernel must build and load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from curvalign import _native
from curvalign.geometry import _fused_l1, _fused_lorentz
from curvalign.nn import _fused_router

KERNELS = {
    "l1": _fused_l1.KERNEL,
    "lorentz": _fused_lorentz.KERNEL,
    "router": _fused_router.KERNEL,
}


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX") or "g++") is None,
    reason="no C++ compiler: the eager references are used, as documented",
)
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_builds_where_a_compiler_exists(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CURVALIGN_FUSED", raising=False)
    kernel = KERNELS[name]
    library = kernel.load()
    assert library is not None, f"the {kernel.what} did not build: {kernel.failed}"
    assert kernel.available(torch.zeros(1))
    assert _native.enabled()


def test_constant_under_compile_marks_a_function_as_torch_does() -> None:
    from curvalign._native import constant_under_compile

    def by_torch() -> int:
        return 1

    def by_curvalign() -> int:
        return 1

    assert torch.compiler.assume_constant_result(by_torch) is by_torch
    assert constant_under_compile(by_curvalign) is by_curvalign
    assert vars(by_curvalign) == vars(by_torch) and vars(by_torch)


def test_importing_curvalign_does_not_import_dynamo() -> None:
    # Dynamo's import is seconds of every process start; only torch.compile needs it
    code = (
        "import sys, curvalign.cli, curvalign.index, curvalign.geometry.product, "
        "curvalign.recipes.phyclip; print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
