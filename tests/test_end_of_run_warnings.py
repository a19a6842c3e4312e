"""The end-of-run warnings on a validation curve never contradict each other: one line at most
(``eval.health.convergence_warning``), "train longer" only where the best validation lies in
the curve's tail, never beside "best at step 78 of 300" of a curve that fell and rises again."""

from __future__ import annotations

import random

from curvalign.eval.health import health
from curvalign.stats import curve_convergence

ADVICE = "train longer"
KINDS = ("still rising", "fell after its best", "stopped improving early")


def _curve(values, every=10):
    return [(i * every, v) for i, v in enumerate(values)]


def _lines(history):
    out = health([], history, history[-1][0], set())
    return out, [w for w in out.warnings if any(k in w for k in KINDS)]


def test_a_curve_that_dipped_and_recovers_below_its_best_is_not_told_to_train_longer():
    # best at step 10 of 70, then a dip, then a rise that stays below the best (the reported
    # contradiction: "still moving up ... best at step 78 of 300 ... train longer")
    history = _curve([0.30, 0.40, 0.35, 0.30, 0.31, 0.33, 0.35, 0.37])
    out, lines = _lines(history)
    assert out.converged is False and len(lines) == 1
    assert "fell after its best (step 10 of 70)" in lines[0] and ADVICE not in lines[0]


def test_a_curve_rising_to_its_end_is_told_to_train_longer():
    out, lines = _lines(_curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
    assert out.converged is False and len(lines) == 1
    assert "still rising" in lines[0] and ADVICE in lines[0] and "best at step 50 of 50" in lines[0]


def test_the_warnings_agree_with_the_curve_on_random_curves():
    rng = random.Random(7)
    seen = set()
    for _ in range(400):
        n = rng.randint(3, 30)
        values = [rng.random() for _ in range(n)]
        if rng.random() < 0.3:  # some monotone tails too
            values = sorted(values[: n // 2]) + sorted(values[n // 2 :])
        history = _curve(values)
        out, lines = _lines(history)
        reading = curve_convergence(history, 0.005)
        assert len(lines) <= 1
        if not lines:
            continue
        line = lines[0]
        seen.update(k for k in KINDS if k in line)
        best_step = max(history, key=lambda item: (item[1], -item[0]))[0]
        last = history[-1][0]
        assert sum(k in line for k in KINDS) == 1
        if ADVICE in line:  # the advice only where the best is in the rising tail
            assert out.converged is False and best_step >= reading["tail_start"]
        if "stopped improving early" in line:
            assert out.converged is True and best_step <= last / 2
        if "still rising" in line:
            assert ADVICE in line
        if "fell after its best" in line:  # the best before the tail: no advice to train on
            assert out.converged is False and best_step < reading["tail_start"]
            assert ADVICE not in line
    assert seen == set(KINDS)  # every kind of line was exercised
