"""Runs the Triton l1-product kernels under Triton's CPU interpreter, in a process of its own.

``tests/test_geometry_triton.py`` starts it with ``TRITON_INTERPRET=1`` in its environment.
Triton reads that variable when a function is decorated with ``@triton.jit``, and its standard
library (``tl.zeros``, ``tl.cdiv``, ...) is decorated when ``triton`` is first imported: the
interpreter has to be on before the first ``import triton`` of a process, and switching it on
inside the pytest process would change every later user of triton there. So the kernels run
here, on CPU tensors, through ``product.l1_pairwise_dist`` with its choice of path forced to
``"triton"``; the test process compares the results with the eager reference.

With ``cuda`` as a third argument it runs the same cases on the GPU instead, compiled, without
the interpreter and without forcing the path (a CUDA tensor takes the Triton kernels by itself):
the test process then compares real GPU results with the same reference.

Usage: ``python _triton_interpret_worker.py CASES.pt RESULTS.pt [interpreter|cuda]``
(``torch.save``'d dicts: case name -> inputs, case name -> outputs or an error message).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

#: the results' key for the warnings raised while the cases ran
WARNINGS = "__warnings__"
#: where the cases run: "cpu" under the interpreter, "cuda" on a GPU (``main`` sets it)
DEVICE = "cpu"


def _grads(case: dict) -> dict:
    """Value, gradients (``None`` where an input needs none) and the autograd node's name."""
    from curvalign.geometry import product

    inputs = {
        name: case[name].detach().clone().requires_grad_(name in case["grad"])
        for name in ("X", "Y", "c")
    }
    out = product.l1_pairwise_dist(inputs["X"], inputs["Y"], inputs["c"])
    node = type(out.grad_fn).__name__ if out.grad_fn is not None else ""
    wanted = [inputs[name] for name in case["grad"]]
    grads = dict(
        zip(case["grad"], torch.autograd.grad((out * case["w"]).sum(), wanted), strict=True)
    )
    return {"value": out.detach(), "node": node, **{f"d{k}": grads.get(k) for k in "XYc"}}


def _autocast(case: dict) -> dict:
    from curvalign.geometry import product

    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = product.l1_pairwise_dist(case["X"].bfloat16(), case["Y"].bfloat16(), case["c"])
    return {"value": out}


def _gradcheck(case: dict) -> dict:
    from curvalign.geometry import product

    args = tuple(case[n].detach().clone().requires_grad_() for n in ("X", "Y", "c"))
    ok = torch.autograd.gradcheck(lambda a, b, c: product.l1_pairwise_dist(a, b, c), args)
    return {"ok": bool(ok)}


def _ready(case: dict) -> dict:
    from curvalign.geometry import _triton_l1

    return {"ok": _triton_l1.ready(torch.device(DEVICE), case["dtype"], case["width"])}


def _compiled(case: dict) -> dict:
    """The Triton path under ``torch.compile(fullgraph=True)`` (``aot_eager``: Dynamo and
    AOTAutograd around the opaque custom ops; the kernels run in the interpreter), at two row
    counts: values and gradients, to compare with the eager reference."""
    from curvalign.geometry import product

    compiled = torch.compile(product.l1_pairwise_dist, backend="aot_eager", fullgraph=True)
    out = {}
    for rows in case["rows"]:
        X = case["X"][:rows].detach().clone().requires_grad_()
        Y, c = (case[n].detach().clone().requires_grad_() for n in ("Y", "c"))
        value = compiled(X, Y, c)
        grads = torch.autograd.grad((value * case["w"][:rows]).sum(), (X, Y, c))
        out[rows] = {"value": value.detach(), "dX": grads[0], "dY": grads[1], "dc": grads[2]}
    return out


RUN = {
    "grads": _grads,
    "autocast": _autocast,
    "gradcheck": _gradcheck,
    "ready": _ready,
    "compiled": _compiled,
}


def _moved(value, device: str):  # noqa: ANN001, ANN202
    """``value`` with every tensor in it (dicts, tuples, lists) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    return value


def main(src: str, dst: str, mode: str = "interpreter") -> None:
    global DEVICE
    if mode == "interpreter" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (see the module docstring)")
    if mode == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda mode needs a CUDA GPU")
    torch.set_num_threads(1)
    from curvalign.geometry import _triton_l1, product

    # Small tiles, so that small inputs span several (and the masks of partial tiles run).
    _triton_l1.BLOCKS = (16, 16)
    if mode == "interpreter":
        product._l1_path = lambda device, dtype, width: "triton"  # CPU tensors take the Triton path
    else:
        DEVICE = "cuda"
    results = {}
    with warnings.catch_warnings(record=True) as caught:  # e.g. "the kernels do not run"
        warnings.simplefilter("always")
        for name, case in torch.load(src).items():
            try:
                results[name] = _moved(RUN[case["kind"]](_moved(case, DEVICE)), "cpu")
            except Exception as exc:  # noqa: BLE001 - reported per case by the test process
                results[name] = f"{type(exc).__name__}: {exc}"
    results[WARNINGS] = [str(w.message) for w in caught]
    torch.save(results, dst)


if __name__ == "__main__":
    main(*sys.argv[1:4])
