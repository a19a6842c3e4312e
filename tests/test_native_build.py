"""Every native kernel builds wherever a C++ compiler is present.

The kernel tests skip when their kernel is not available (a machine without a compiler falls
back to the eager references, by design), so a source that stops compiling would turn them
into skips, not failures. This test makes it a failure: on a machine with ``g++`` (CI has it),
each kernel must build and load.
"""

from __future__ import annotations

import os
import shutil

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
