"""The Triton kernels of the l1-product distance (CUDA path) against the eager reference.

The kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``) in one subprocess
(``_triton_interpret_worker.py``; the module docstring there says why not in this process),
through ``product.l1_pairwise_dist`` with its choice of path forced to ``"triton"`` and 16 x 16
tiles; where a CUDA GPU is present, the same cases also run compiled on it in a second
subprocess (the path then the one a CUDA tensor takes by itself). This process computes the reference (``fused=False``) and compares values and gradients
(X, Y and the per-factor curvature c) in float32 and float64, on odd sizes, several factor
counts and widths, and the edge matrix. Also here, without running a kernel: the choice of path
for CUDA tensors, the switch ``CURVALIGN_FUSED=0``, the fallbacks when triton fails to import or
a kernel fails to run, and a compilation of the kernels for sm_90 by the real Triton compiler.
Everything that needs triton skips, saying so, where it is not installed (the ``triton`` extra).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import curvalign
from _l1_edge import assert_edge_agrees
from curvalign.geometry import lorentz as L
from curvalign.geometry import product as P

f32, f64 = torch.float32, torch.float64
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]'): kernels untested"
)
WORKER = Path(__file__).with_name("_triton_interpret_worker.py")


def points(seed: int, n: int, k: int, d: int, dtype: torch.dtype, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, k, d, generator=g, dtype=f64) * (scale / d**0.5)
    return L.expmap0(v, 1.0).to(dtype)


def weights(n: int, m: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, m, generator=torch.Generator().manual_seed(seed), dtype=f64).to(dtype)


def grads_case(X, Y, c, w=None, grad=("X", "Y", "c")) -> dict:  # noqa: ANN001
    w = weights(X.shape[0], Y.shape[0], X.dtype) if w is None else w
    return {"kind": "grads", "X": X, "Y": Y, "c": c, "w": w, "grad": tuple(grad)}


# --- the cases the interpreter runs ------------------------------------------------------------

# 16 x 16 tiles: one, partial, and two each way (a full tile then a partial one, the backward
# loops running twice) with the other side an exact multiple of the tile. The interpreter
# pays per tile, so these are the fewest tiles that reach every mask and loop case.
SIZES = [(1, 1), (5, 3), (16, 17), (17, 16)]
FACTORS = [(1, 2), (3, 8), (64, 8), (2, 31)]  # (k, d): PHyCLIP is k = 64, d = 8
EDGE_SCALES = [0.0, 1e-6, 1.0, 1e4]
EDGE_C = [0.1, 10.0]


def edge_inputs(scale: float, c: float) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 3, generator=g)
    x = x / x.norm(dim=-1, keepdim=True) * scale
    other = torch.randn(6, 4, 3, generator=g) * max(scale, 1.0)
    cc = torch.tensor([c, c, 1.0, c])
    w = torch.linspace(0.5, 1.5, 36).view(6, 6)
    return {"x=y": (x, x.clone(), cc, w), "x=0": (torch.zeros_like(x), other, cc, w)}


def all_cases() -> dict[str, dict]:
    cases: dict[str, dict] = {}
    c5 = [0.1, 0.5, 1.0, 3.0, 10.0]
    for dtype in (f32, f64):
        for N, M in SIZES:
            X, Y = points(N, N, 5, 4, dtype), points(100 + M, M, 5, 4, dtype, scale=2.0)
            cases[f"sizes-{dtype}-{N}x{M}"] = grads_case(X, Y, torch.tensor(c5, dtype=dtype))
    for k, d in FACTORS:
        # one tile (SIZES checks the tiling): these check the factor loop and the widths, and
        # the interpreter's cost grows with tiles x factors (k = 64 over 2 x 2 tiles took 4 min)
        X, Y = points(k, 7, k, d, f32), points(k + 1, 5, k, d, f32, scale=1.5)
        c = torch.linspace(0.2, 4.0, k)
        cases[f"factors-{k}-{d}"] = grads_case(X, Y, c)
    for scale in EDGE_SCALES:
        for c in EDGE_C:
            for name, (a, b, cc, w) in edge_inputs(scale, c).items():
                cases[f"edge-{name}-{scale}-{c}"] = grads_case(a, b, cc, w)
    X, Y = points(20, 9, 3, 4, f64), points(21, 11, 3, 4, f64)
    c3 = torch.tensor([0.3, 1.0, 4.0], dtype=f64)
    cases["only-Y"] = grads_case(X, Y, c3, grad=("Y",))
    cases["only-X"] = grads_case(X, Y, c3, grad=("X",))
    base = points(7, 9, 6, 3, f64)
    Xs = base[::2].transpose(0, 1).contiguous().transpose(0, 1)  # [5, 6, 3], non-contiguous
    Ys = points(8, 6, 12, 3, f64)[:, ::2]  # [6, 6, 3], strided factors
    cases["strided-scalar-c"] = grads_case(Xs, Ys, torch.tensor(0.7, dtype=f64))
    Xa, Ya = points(3, 7, 4, 3, f32), points(4, 9, 4, 3, f32)
    cases["autocast"] = {"kind": "autocast", "X": Xa, "Y": Ya, "c": torch.tensor([0.5, 1, 2, 4.0])}
    cases["gradcheck"] = {
        "kind": "gradcheck",
        "X": points(5, 3, 2, 2, f64),
        "Y": points(6, 2, 2, 2, f64),
        "c": torch.tensor([0.4, 3.0], dtype=f64),
    }
    cases["ready"] = {"kind": "ready", "dtype": f32, "width": 9}
    Xc, Yc = points(30, 13, 3, 4, f64), points(31, 10, 3, 4, f64)
    cases["compiled"] = {
        "kind": "compiled", "X": Xc, "Y": Yc, "c": torch.tensor([0.5, 1.0, 2.0], dtype=f64),
        "w": weights(13, 10, f64), "rows": (9, 13),
    }  # fmt: skip
    return cases


#: a known bug of older tritons' CPU interpreter (seen with triton 3.6 and numpy 2.x): a loop
#: over a scalar kernel argument fails, so no kernel of ours can run there
_OLD_INTERPRETER = "only 0-dimensional arrays can be converted to Python scalars"


@pytest.fixture(scope="module", params=["interpreter", "cuda"])
def interpreted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Every case run once in one subprocess, (cases, results): under Triton's CPU interpreter,
    and (where a CUDA GPU is present) compiled on the GPU, where the path is not forced."""
    mode = request.param
    if mode == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the kernels are checked under the interpreter only")
    cases = all_cases()
    folder = tmp_path_factory.mktemp(f"triton_{mode}")
    src, dst = folder / "cases.pt", folder / "results.pt"
    torch.save(cases, src)
    # The child imports the same curvalign as this process, with the interpreter on from its start.
    package_root = str(Path(curvalign.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    if mode == "interpreter":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run(
        [sys.executable, str(WORKER), str(src), str(dst), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, f"{mode} worker failed:\n{run.stderr[-4000:]}"
    results = torch.load(dst)
    raised = results.pop("__warnings__", [])
    old_interpreter = [w for w in raised if _OLD_INTERPRETER in w]
    if mode == "interpreter" and old_interpreter:
        import triton

        pytest.skip(
            f"triton {triton.__version__}'s CPU interpreter cannot run a loop over a scalar "
            f"argument with this numpy ({old_interpreter[0][:200]}): a triton bug, not the "
            "kernels'; where a CUDA GPU is present the same cases run on it"
        )
    return cases, results


def result(interpreted: tuple[dict, dict], name: str) -> tuple[dict, dict]:
    cases, results = interpreted
    got = results[name]
    assert not isinstance(got, str), f"{name}: the Triton path raised {got}"
    return cases[name], got


def reference(case: dict) -> dict:
    inputs = {
        n: case[n].detach().clone().requires_grad_(n in case["grad"]) for n in ("X", "Y", "c")
    }
    out = P.l1_pairwise_dist(inputs["X"], inputs["Y"], inputs["c"], fused=False)
    wanted = [inputs[n] for n in case["grad"]]
    grads = dict(
        zip(case["grad"], torch.autograd.grad((out * case["w"]).sum(), wanted), strict=True)
    )
    return {"value": out.detach(), **{f"d{k}": grads.get(k) for k in "XYc"}}


def assert_close(got, ref, dtype, what: str, tol: float | None = None) -> None:  # noqa: ANN001
    # Relative to the largest entry: the kernels and the reference sum in different orders.
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape} {got.dtype}"
    scale = ref.abs().max().clamp_min(1.0)
    tol = tol if tol is not None else (1e-11 if dtype == f64 else 2e-5)
    err = (got - ref).abs().max() / scale
    assert err < tol, f"{what}: max error {err:.3g} (relative to {scale:.3g}) above {tol}"


def check_against_reference(interpreted, name: str) -> None:  # noqa: ANN001
    case, got = result(interpreted, name)
    assert "curvalign_l1_triton_forward" in got["node"], (
        f"{name}: took {got['node']!r}, not the Triton kernels"
    )
    ref = reference(case)
    dtype = case["X"].dtype
    truth = reference(in_float64(case)) if dtype == f32 else None
    for what in ("value", "dX", "dY", "dc"):
        if ref[what] is None:
            assert got[what] is None, f"{name}: {what} computed though not requested"
        elif truth is None:
            assert_close(got[what], ref[what], dtype, f"{name}: {what}")
        else:
            # float32: as close to the float64 truth as the eager float32 reference, within a
            # factor 4 (compiled GPU code contracts FMAs and sums in another order: on an H200
            # dY of factors-1-2 was 2.5e-5 from the float32 reference, 2e-5 the old bound)
            own = relative_error(ref[what], truth[what])
            err = relative_error(got[what].double(), truth[what])
            assert err < max(2e-5, 4 * own), (
                f"{name}: {what}: max error {err:.3g} from float64 (the eager float32 "
                f"reference's: {own:.3g})"
            )


def in_float64(case: dict) -> dict:
    """``case`` with its inputs and weights in float64: the truth a float32 result is held to."""
    return {**case, **{n: case[n].double() for n in ("X", "Y", "c", "w")}}


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest entry of ``truth`` (at least 1)."""
    return float((got.double() - truth).abs().max() / truth.abs().max().clamp_min(1.0))


@needs_triton
def test_triton_under_torch_compile_matches_eager(interpreted) -> None:  # noqa: ANN001
    """``torch.compile(fullgraph=True)`` through the Triton path (custom ops, opaque to Dynamo)
    at two row counts: the eager reference's values and gradients."""
    case, got = result(interpreted, "compiled")
    for rows in case["rows"]:
        sub = {**case, "X": case["X"][:rows], "w": case["w"][:rows], "grad": ("X", "Y", "c")}
        ref = reference(sub)
        for what in ("value", "dX", "dY", "dc"):
            assert_close(got[rows][what], ref[what], f64, f"compiled, {rows} rows: {what}")


@needs_triton
@pytest.mark.parametrize("dtype", [f32, f64])
@pytest.mark.parametrize(("N", "M"), SIZES)
def test_triton_matches_reference(interpreted, dtype: torch.dtype, N: int, M: int) -> None:  # noqa: ANN001
    check_against_reference(interpreted, f"sizes-{dtype}-{N}x{M}")


@needs_triton
@pytest.mark.parametrize(("k", "d"), FACTORS)
def test_triton_factor_counts_and_widths(interpreted, k: int, d: int) -> None:  # noqa: ANN001
    check_against_reference(interpreted, f"factors-{k}-{d}")


@needs_triton
@pytest.mark.parametrize("name", ["only-Y", "only-X", "strided-scalar-c"])
def test_triton_partial_gradients_strides_scalar_curvature(interpreted, name: str) -> None:  # noqa: ANN001
    check_against_reference(interpreted, name)


@needs_triton
@pytest.mark.parametrize("c", EDGE_C)
@pytest.mark.parametrize("scale", EDGE_SCALES)
def test_triton_edge_matrix(interpreted, scale: float, c: float) -> None:  # noqa: ANN001
    """x = y, x = 0, huge norms, c at 0.1 and 10: finite, and equal to the reference.

    The same criteria as the CPU kernel's edge test (tests/_l1_edge.py).
    """
    for name in ("x=y", "x=0"):
        case, got = result(interpreted, f"edge-{name}-{scale}-{c}")
        ref = reference(case)
        for what in ("value", "dX", "dY", "dc"):
            u, v = got[what], ref[what]
            assert_edge_agrees(name, scale, c, what, u, v)


@needs_triton
def test_triton_bf16_autocast_computes_in_float32(interpreted) -> None:  # noqa: ANN001
    case, got = result(interpreted, "autocast")
    assert got["value"].dtype == f32
    X, Y = case["X"].bfloat16().float(), case["Y"].bfloat16().float()
    ref = P.l1_pairwise_dist(X, Y, case["c"], fused=False)
    assert_close(got["value"], ref, f32, "bf16 autocast")


@needs_triton
def test_triton_gradcheck_float64(interpreted) -> None:  # noqa: ANN001
    assert result(interpreted, "gradcheck")[1]["ok"]


@needs_triton
def test_ready_probe_passes_where_the_kernels_run(interpreted) -> None:  # noqa: ANN001
    assert result(interpreted, "ready")[1]["ok"] is True


# --- the choice of path and the fallbacks (no kernel runs in this process) ---------------------

CUDA = torch.device("cuda")


def test_cuda_tensors_take_the_triton_path_when_triton_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(P, "_triton_installed", lambda: True)
    assert P._l1_path(CUDA, f32, 9) == "triton"
    assert P._l1_path(torch.device("cuda", 1), f64, 9) == "triton"
    assert P._l1_path(CUDA, f32, P._TRITON_MAX_WIDTH + 1) == "reference"
    assert P._l1_path(torch.device("cpu"), f32, 9) == "cpu"
    assert P._l1_path(torch.device("mps"), f32, 9) == "reference"
    monkeypatch.setattr(P, "_triton_installed", lambda: False)
    assert P._l1_path(CUDA, f32, 9) == "reference"


def test_the_choice_of_path_compiles_in_one_graph_for_cuda_points() -> None:
    """``torch.compile(fullgraph=True)`` of a model on a GPU traces ``_l1_path`` for CUDA
    tensors: the probe for triton must be a constant to Dynamo (found on an H200, where
    ``importlib.util.find_spec`` inside the probe broke the graph)."""

    def uses_the_choice(x: torch.Tensor) -> torch.Tensor:
        return x + float(P._l1_path(CUDA, f32, 9) == "triton")

    compiled = torch.compile(uses_the_choice, backend="eager", fullgraph=True)
    expected = float(P._l1_path(CUDA, f32, 9) == "triton")
    assert compiled(torch.zeros(1)).item() == expected


def test_env_switch_turns_the_triton_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "_triton_installed", lambda: True)
    monkeypatch.setenv("CURVALIGN_FUSED", "0")
    assert P._l1_path(CUDA, f32, 9) == "reference"
    assert P._l1_path(torch.device("cpu"), f32, 9) == "reference"


@pytest.mark.parametrize("findable", [False, True])
def test_cuda_points_take_triton_only_where_triton_can_be_found(
    monkeypatch: pytest.MonkeyPatch, findable: bool
) -> None:
    """The CUDA path is chosen from whether ``triton`` can be found, without importing it."""
    spec = object() if findable else None
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: spec if name == "triton" else None
    )
    P._TRITON_FOUND.clear()
    try:
        cuda = torch.device("cuda")
        assert P._l1_path(cuda, f32, 9) == ("triton" if findable else "reference")
        # wider factors than the kernels take, and other devices, never take Triton
        assert P._l1_path(cuda, f32, P._TRITON_MAX_WIDTH + 1) == "reference"
        assert P._l1_path(torch.device("meta"), f32, 9) == "reference"
    finally:
        P._TRITON_FOUND.clear()


def test_triton_that_fails_to_import_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str):  # noqa: ANN202
        raise ImportError(f"simulated: cannot import {name}")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.warns(RuntimeWarning, match="does not import"):
        assert P._triton_kernels.__wrapped__() is None
    monkeypatch.setattr(P, "_l1_path", lambda device, dtype, width: "triton")
    monkeypatch.setattr(P, "_triton_kernels", lambda: None)
    X, Y = points(0, 6, 3, 2, f64), points(1, 5, 3, 2, f64)
    got = P.l1_pairwise_dist(X.requires_grad_(), Y, 1.0)
    assert "curvalign_l1_triton_forward" not in type(got.grad_fn).__name__
    assert torch.equal(got, P.l1_pairwise_dist(X, Y, 1.0, fused=False))


@needs_triton
def test_kernels_that_cannot_run_warn_once_and_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Here (no GPU, no interpreter) launching a compiled kernel fails: one warning, then the
    reference, with the reference's values."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels would run")
    from curvalign.geometry import _triton_l1

    monkeypatch.setattr(_triton_l1, "_READY", {})
    monkeypatch.setattr(P, "_l1_path", lambda device, dtype, width: "triton")
    X, Y = points(0, 6, 3, 2, f64), points(1, 5, 3, 2, f64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = P.l1_pairwise_dist(X, Y, 1.0)
        second = P.l1_pairwise_dist(X, Y, 1.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "Triton l1-product kernels do not run" in messages[0]
    ref = P.l1_pairwise_dist(X, Y, 1.0, fused=False)
    assert torch.equal(first, ref) and torch.equal(second, ref)


@needs_triton
def test_width_limit_agrees_with_the_kernels() -> None:
    from curvalign.geometry import _triton_l1

    assert P._TRITON_MAX_WIDTH == _triton_l1.MAX_WIDTH
    X = torch.zeros(2, 1, _triton_l1.MAX_WIDTH)  # d + 1 = MAX_WIDTH + 1
    with pytest.raises(ValueError, match="factor width"):
        _triton_l1.l1_pairwise_dist_triton(X, X, torch.ones(2))


@needs_triton
@pytest.mark.parametrize("dtype", [f32, f64])
def test_real_compiler_accepts_the_kernels_for_sm90(dtype: torch.dtype) -> None:
    """The interpreter runs the Python of a kernel; this compiles it with Triton's own compiler
    (to PTX and, with the ptxas in Triton's wheel, to an sm_90 binary). No GPU needed."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels are interpreted functions")
    from curvalign.geometry import _triton_l1

    compiled = _triton_l1.compile_for(90, dtype, width=9)
    assert set(compiled) == {"forward", "backward"}
    for name, kernel in compiled.items():
        ptx = kernel.asm["ptx"]
        assert ".entry" in ptx and len(kernel.asm["cubin"]) > 1000, name
        if dtype == f64:
            # A float literal standing alone compiles to a float32 constant: none may reach a
            # float64 kernel (the interpreter, computing in numpy, would not show it).
            assert ".f32" not in ptx, f"{name}: float32 arithmetic in the float64 kernel"
            for hexa in re.findall(r"0d([0-9A-F]{16})", ptx):
                bits = int(hexa, 16)
                value = struct.unpack(">d", bytes.fromhex(hexa))[0]
                rounded = bits & ((1 << 29) - 1) == 0  # no mantissa bits beyond float32's
                assert not rounded or value in (0.0, 0.5, -0.5, 1.0, -1.0, 2.0, math.inf), (
                    f"{name}: float64 constant {value!r} carries only float32 precision"
                )
