"""Evaluating one trained run, as ``curvalign eval RUN`` reports it: its own data (or another
store), an optional retrieval protocol, every metric the data supports, the run's identity in
``meta`` and its health (``curvalign.eval.health``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from curvalign.eval.result import EvaluationResult
from curvalign.runs import LoadedRun


@dataclass(frozen=True)
class RunEvaluation:
    """What ``evaluate_run`` gives: the loaded ``run``, the evaluation ``result`` (``evaluate``'s
    record with the run in ``meta.run`` and its ``health``), the data ``spec`` it was
    evaluated on and the ``split`` used (``"test"`` under a protocol)."""

    run: LoadedRun
    result: EvaluationResult
    spec: str
    split: str


def evaluate_run(
    run_dir: str | Path,
    *,
    data: str | None = None,
    split: str = "test",
    batch_size: int = 1024,
    protocol: str | None = None,
    weights: str = "best",
    on_loaded: Callable[[LoadedRun], None] | None = None,
) -> RunEvaluation:
    """Evaluate the run in ``run_dir`` (its ``weights``: best or last) on ``data`` (default: the
    run's own data spec) and ``split``; ``protocol`` (or the store's ``meta.protocol``) recasts
    the store as that retrieval protocol's test split. ``on_loaded(run)`` is called once the run
    is read (the CLI prints its notes there, before the data is loaded)."""
    from curvalign.data import load_store
    from curvalign.data.protocols import get_protocol, protocol_store
    from curvalign.eval import evaluate
    from curvalign.eval.health import health_of_run
    from curvalign.runs import load_run

    run = load_run(run_dir, weights=weights)
    if on_loaded is not None:
        on_loaded(run)
    store, spec = load_store(run.data_spec(data))
    name = protocol or store.meta.get("protocol")
    if name is not None:
        store = protocol_store(store, get_protocol(name), split)
        split = "test"
    result = evaluate(run.recipe, store, split=split, batch_size=batch_size).with_run(
        health=health_of_run(run),
        step=run.step,
        weights=run.weights,
        last_step=run.last_step,
        best_step=run.best_step,
        run_dir=str(run_dir),
        data=spec,
        **({"note": run.note} if run.note else {}),
    )
    return RunEvaluation(run, result, spec, split)


__all__ = ["RunEvaluation", "evaluate_run"]
