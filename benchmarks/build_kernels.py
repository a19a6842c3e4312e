"""How long each native CPU kernel takes to build on first use, and to load once cached.

Builds every kernel into a fresh, empty cache directory (``TORCH_EXTENSIONS_DIR`` pointed at a
temporary folder, so the user's cache is neither used nor touched), then loads each again from
that cache in a second process, as a later run would.

    python benchmarks/build_kernels.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def timings() -> dict[str, float]:
    import torch

    from curvalign.geometry import _fused_l1, _fused_lorentz
    from curvalign.nn import _fused_router

    seconds = {}
    for module in (_fused_l1, _fused_lorentz, _fused_router):
        t0 = time.perf_counter()
        if not module.KERNEL.available(torch.zeros(1)):
            raise SystemExit(f"the {module.KERNEL.what} did not build: {module.KERNEL.failed}")
        seconds[module.KERNEL.what] = time.perf_counter() - t0
    return seconds


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(timings()))
        return
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache, "CURVALIGN_FUSED": "1"}
        runs = [
            json.loads(
                subprocess.run(
                    [sys.executable, __file__, "--child"],
                    check=True,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                .stdout.strip()
                .splitlines()[-1]
            )  # fmt: skip
            for _ in range(2)
        ]
    print(f"{'kernel':<38} {'first build (s)':>16} {'cached load (s)':>16}")
    for what in runs[0]:
        print(f"{what:<38} {runs[0][what]:16.2f} {runs[1][what]:16.4f}")


if __name__ == "__main__":
    main()
