"""A study's result as typed records, and their JSON (``study.json``).

``ClaimResult``   one decided claim (``kit.claim_record``; re-decided with its plan by
                  ``kit.with_plan`` and Holm's correction by ``kit.apply_holm``, both with
                  ``dataclasses.replace``)
``StudyResult``   one study's result (``declare.run_declared`` / ``declare.run_own``; the command
                  added by ``runner.run_study``), read by the pages (``page``, ``results``)

Sub-records where the shape is fixed: the intervals are ``curvalign.stats.Interval`` (or its
``TwoLevelInterval`` where the interval counts test items), ``DecisionInputs`` (what ``kit.decide``
was given), ``PlanRecord`` (a claim's power plan), ``PowerPlan``, ``LrChoice``, ``Convergence``,
``ControlRecord`` with its ``DoseChoice`` and ``MeasuredControlRecord``. A step-0 start
(``kit.start_record``, or a study's own trainer's) stays a JSON mapping.

``to_json()`` writes the JSON shape the studies have always written, key for key (a key that an
older ``study.json`` lacks is ``None`` here and stays absent; keys this module does not know,
such as the former scripted studies' own entries, are kept in ``extra`` and written back), and
``from_json(d)`` reads every ``study.json`` the studies wrote. JSON has no NaN: a non-finite
float is written as ``null`` (``curvalign.report.tables.write_json``) and read back as ``nan`` where the
field is a number.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from curvalign.errors import InputError
from curvalign.stats import Interval, TwoLevelInterval

JSON = dict[str, Any]

_INTERVAL_KEYS = frozenset(f.name for f in dataclasses.fields(Interval))
_TWO_LEVEL_KEYS = frozenset(f.name for f in dataclasses.fields(TwoLevelInterval))


def _num(value: Any) -> Any:
    """A number field read from JSON: ``null`` (a NaN or infinity when written) is ``nan``; any
    other value is kept as it is (an int stays an int, so that it is written back the same)."""
    return math.nan if value is None else value


def _need(d: Mapping[str, Any], key: str, what: str) -> Any:
    if not isinstance(d, Mapping):
        raise InputError(f"{what}: expected a JSON object, got {type(d).__name__}")
    if key not in d:
        raise InputError(
            f"{what} has no {key!r} (expected a study result as `curvalign study` writes it)"
        )
    return d[key]


def _extra(d: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in known}


def interval_to_json(iv: Interval) -> JSON:
    """``{"mean", "low", "high", "n"}`` (and a two-level interval's own fields)."""
    return iv.as_dict()


def interval_from_json(d: Mapping[str, Any], what: str = "interval") -> Interval:
    """An ``Interval`` (a ``TwoLevelInterval`` where ``d`` has its fields)."""
    keys = set(d) if isinstance(d, Mapping) else set()
    if keys == _TWO_LEVEL_KEYS:
        return TwoLevelInterval(**{k: _num(v) if k != "items" else v for k, v in d.items()})
    if keys != _INTERVAL_KEYS:
        raise InputError(f"{what}: expected an interval {sorted(_INTERVAL_KEYS)}, got {d!r}")
    return Interval(_num(d["mean"]), _num(d["low"]), _num(d["high"]), d["n"])


def _interval_or_none(d: Mapping[str, Any] | None, what: str) -> Interval | None:
    return None if d is None else interval_from_json(d, what)


def _iv_json(iv: Interval | None) -> JSON | None:
    return None if iv is None else interval_to_json(iv)


@dataclass(frozen=True)
class PlanRecord:
    """One claim's power plan as recorded (``rules.Plan.as_dict()``, its ``reason`` kept as
    written): the pilot's per-seed SD on ``pilot_n`` seeds, the ``target`` effect, the planned
    ``n`` (or the ``cap``), the MDE at ``n`` and whether it is ``underpowered`` by plan;
    ``kind`` the claim's kind where the planner recorded it (``kit.plan_seeds``)."""

    pilot_sd: float
    pilot_n: int
    target: float
    n: int
    cap: int
    mde: float
    underpowered: bool
    reason: str
    kind: str | None = None
    #: the size of the Holm family the plan was made for (1: alone, or a record made before
    #: plans were made at the family's level)
    family: int = 1
    #: the test items' standard error the plan counted (0: seeds only, or an older record)
    item_se: float = 0.0
    #: the SD the seeds were planned at where it is not ``pilot_sd`` (a control's upper
    #: confidence limit, ``rules.plan_control``; nan: the pilot's SD, or an older record)
    planned_sd: float = math.nan

    @classmethod
    def from_plan(cls, plan: Any, kind: str | None = None) -> PlanRecord:
        """From a ``rules.Plan``."""
        return cls(
            plan.pilot_sd,
            plan.pilot_n,
            plan.target,
            plan.n,
            plan.cap,
            plan.mde,
            plan.underpowered,
            plan.reason,
            kind,
            getattr(plan, "family", 1),
            getattr(plan, "item_se", 0.0),
            getattr(plan, "planned_sd", math.nan),
        )

    def to_json(self) -> JSON:
        out: JSON = {
            "pilot_sd": self.pilot_sd,
            "pilot_n": self.pilot_n,
            "target": self.target,
            "n": self.n,
            "cap": self.cap,
            "mde": self.mde,
            "underpowered": self.underpowered,
            "reason": self.reason,
        }
        if self.kind is not None:
            out["kind"] = self.kind
        if self.family != 1:
            out["family"] = self.family
        if self.item_se:
            out["item_se"] = self.item_se
        if math.isfinite(self.planned_sd):
            out["planned_sd"] = self.planned_sd
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PlanRecord:
        what = "a claim's plan"
        return cls(
            _num(_need(d, "pilot_sd", what)),
            _need(d, "pilot_n", what),
            _num(_need(d, "target", what)),
            _need(d, "n", what),
            _need(d, "cap", what),
            _num(_need(d, "mde", what)),
            _need(d, "underpowered", what),
            _need(d, "reason", what),
            d.get("kind"),
            int(d.get("family", 1)),
            float(d.get("item_se", 0.0)),
            _num(d.get("planned_sd", math.nan)),
        )


@dataclass(frozen=True)
class DecisionInputs:
    """What ``kit.decide`` decided a claim from, besides its intervals (``kit.decide``'s keyword
    arguments). ``plan_recorded``: False only for a claim written before claims carried a plan
    (its JSON has no ``plan`` key). ``control_plan``: the seeds the claim's calibrated control
    needs to separate (``rules.plan_control``; None: no pilot, or a claim it does not
    calibrate)."""

    threshold: float = 0.0
    budget_ok: bool = True
    paper_effect: float | None = None
    control_min: float = 0.0
    delta: float | None = None
    precondition: str | None = None
    regime: str | None = None
    plan: PlanRecord | None = None
    scale: float = 100.0
    plan_recorded: bool = True
    control_plan: PlanRecord | None = None

    def to_json(self) -> JSON:
        out: JSON = {
            "threshold": self.threshold,
            "budget_ok": self.budget_ok,
            "paper_effect": self.paper_effect,
            "control_min": self.control_min,
            "delta": self.delta,
            "precondition": self.precondition,
            "regime": self.regime,
        }
        if self.plan_recorded:
            out["plan"] = self.plan.to_json() if self.plan is not None else None
        out["scale"] = self.scale
        if self.control_plan is not None:
            out["control_plan"] = self.control_plan.to_json()
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DecisionInputs:
        what = "a claim's inputs"
        plan = d.get("plan")
        control_plan = d.get("control_plan")
        return cls(
            threshold=_need(d, "threshold", what),
            budget_ok=_need(d, "budget_ok", what),
            paper_effect=d.get("paper_effect"),
            control_min=_need(d, "control_min", what),
            delta=d.get("delta"),
            precondition=d.get("precondition"),
            regime=d.get("regime"),
            plan=PlanRecord.from_json(plan) if plan is not None else None,
            scale=_need(d, "scale", what),
            plan_recorded="plan" in d,
            control_plan=PlanRecord.from_json(control_plan) if control_plan is not None else None,
        )


#: the keys of a claim's JSON, in the order they are written
_CLAIM_KEYS = (
    "claim",
    "role",
    "unit",
    "outcome",
    "verdict",
    "inputs",
    "effect",
    "effect_text",
    "effect_values",
    "p_value",
    "mde",
    "mde_text",
    "paper_effect",
    "paper_source",
    "paper_effect_text",
    "threshold",
    "control",
    "control_what",
    "control_min",
    "control_ok",
    "control_text",
    "sanity",
    "sanity_text",
    "seed_only",
    "seed_only_control",
    "key",
    "words",
    "kind",
    "note",
    "two_level",
    "plan",
    "planned_n_text",
    "holm_significant",
    "holm_family",
    "holm_verdict",
    "holm_outcome",
)


@dataclass(frozen=True)
class ClaimResult:
    """One decided claim (``kit.claim_record``; ``kit.RULE``).

    claim, role, unit         the claim's statement, its role (primary ... precondition, regime)
                              and the unit of its texts
    verdict, outcome          the verdict class (``kit.VERDICTS``) and its text, before Holm
    inputs                    what the verdict was decided from (``DecisionInputs``)
    effect, effect_text       the effect's 95% interval (oriented: the claim says effect >
                              threshold) and its text; ``effect_values`` the per-seed effects
    p_value, mde, mde_text    the paired t test's p against the threshold; the descriptive MDE
    paper_effect, paper_source, paper_effect_text
                              the paper's effect on this metric and where the paper states it
    control, control_what, control_min, control_ok, control_text
                              the calibrated control's interval, what it is, the size it must
                              reach, whether it separated, its text
    sanity, sanity_text       the trained - untrained row (reported, never decisive)
    seed_only, seed_only_control
                              an older record's seed-only intervals (None: absent)
    key, words, kind, note, two_level
                              a declared claim's key, the paper's words, its kind, the measure's
                              note and whether the interval counts test items (None: absent)
    plan, planned_n_text      the claim's power plan and its planned n (None: no plan)
    holm_significant, holm_family
                              Holm's decision and the family's size (None: outside the family)
    holm_verdict, holm_outcome
                              the verdict re-decided with Holm's decision (None: not yet)
    extra                     keys of an older record this one does not know, kept as read
    """

    claim: str
    role: str
    unit: str
    outcome: str
    verdict: str
    inputs: DecisionInputs
    effect: Interval
    effect_text: str
    effect_values: tuple[float, ...] | None
    p_value: float
    mde: float
    mde_text: str
    paper_effect: float | None
    paper_source: str
    paper_effect_text: str
    threshold: float
    control: Interval | None
    control_what: str
    control_min: float
    control_ok: bool
    control_text: str
    sanity: Interval | None
    sanity_text: str
    seed_only: Interval | None = None
    seed_only_control: Interval | None = None
    key: str | None = None
    words: str | None = None
    kind: str | None = None
    note: str | None = None
    two_level: bool | None = None
    plan: PlanRecord | None = None
    planned_n_text: str | None = None
    holm_significant: bool | None = None
    holm_family: int | None = None
    holm_verdict: str | None = None
    holm_outcome: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def final_verdict(self) -> str:
        """The verdict class after Holm's correction (before it where not yet applied)."""
        return self.holm_verdict if self.holm_verdict is not None else self.verdict

    @property
    def final_outcome(self) -> str:
        """The verdict text after Holm's correction (before it where not yet applied)."""
        return self.holm_outcome if self.holm_outcome is not None else self.outcome

    def to_json(self) -> JSON:
        values: JSON = {
            "claim": self.claim,
            "role": self.role,
            "unit": self.unit,
            "outcome": self.outcome,
            "verdict": self.verdict,
            "inputs": self.inputs.to_json(),
            "effect": interval_to_json(self.effect),
            "effect_text": self.effect_text,
            "effect_values": list(self.effect_values) if self.effect_values is not None else None,
            "p_value": self.p_value,
            "mde": self.mde,
            "mde_text": self.mde_text,
            "paper_effect": self.paper_effect,
            "paper_source": self.paper_source,
            "paper_effect_text": self.paper_effect_text,
            "threshold": self.threshold,
            "control": _iv_json(self.control),
            "control_what": self.control_what,
            "control_min": self.control_min,
            "control_ok": self.control_ok,
            "control_text": self.control_text,
            "sanity": _iv_json(self.sanity),
            "sanity_text": self.sanity_text,
        }
        optional: JSON = {
            "seed_only": _iv_json(self.seed_only),
            "seed_only_control": _iv_json(self.seed_only_control),
            "key": self.key,
            "words": self.words,
            "kind": self.kind,
            "note": self.note,
            "two_level": self.two_level,
            "plan": self.plan.to_json() if self.plan is not None else None,
            "planned_n_text": self.planned_n_text,
            "holm_significant": self.holm_significant,
            "holm_family": self.holm_family,
            "holm_verdict": self.holm_verdict,
            "holm_outcome": self.holm_outcome,
        }
        values |= {k: v for k, v in optional.items() if v is not None}
        return values | dict(self.extra)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClaimResult:
        what = f"claim {d.get('claim')!r}" if isinstance(d, Mapping) else "a claim"

        def need(key: str) -> Any:
            return _need(d, key, what)

        values = d.get("effect_values")
        plan = d.get("plan")
        return cls(
            claim=need("claim"),
            role=need("role"),
            unit=need("unit"),
            outcome=need("outcome"),
            verdict=need("verdict"),
            inputs=DecisionInputs.from_json(need("inputs")),
            effect=interval_from_json(need("effect"), f"{what}, effect"),
            effect_text=need("effect_text"),
            effect_values=tuple(values) if values is not None else None,
            p_value=_num(need("p_value")),
            mde=_num(need("mde")),
            mde_text=need("mde_text"),
            paper_effect=need("paper_effect"),
            paper_source=need("paper_source"),
            paper_effect_text=need("paper_effect_text"),
            threshold=need("threshold"),
            control=_interval_or_none(need("control"), f"{what}, control"),
            control_what=need("control_what"),
            control_min=need("control_min"),
            control_ok=need("control_ok"),
            control_text=need("control_text"),
            sanity=_interval_or_none(need("sanity"), f"{what}, sanity"),
            sanity_text=need("sanity_text"),
            seed_only=_interval_or_none(d.get("seed_only"), f"{what}, seed_only"),
            seed_only_control=_interval_or_none(
                d.get("seed_only_control"), f"{what}, seed_only_control"
            ),
            key=d.get("key"),
            words=d.get("words"),
            kind=d.get("kind"),
            note=d.get("note"),
            two_level=d.get("two_level"),
            plan=PlanRecord.from_json(plan) if plan is not None else None,
            planned_n_text=d.get("planned_n_text"),
            holm_significant=d.get("holm_significant"),
            holm_family=d.get("holm_family"),
            holm_verdict=d.get("holm_verdict"),
            holm_outcome=d.get("holm_outcome"),
            extra=_extra(d, frozenset(_CLAIM_KEYS)),
        )


@dataclass(frozen=True)
class LrChoice:
    """One arm's learning rate chosen on validation: its ``recipe``, the ``chosen`` rate, the
    ``grid`` of (rate, best validation value) pairs tried and the rates ``excluded`` where the
    claim's precondition failed ({rate text: why}; None: an older record without the key)."""

    recipe: str
    chosen: float
    grid: tuple[tuple[float, float], ...]
    excluded: Mapping[str, str] | None = None

    def to_json(self) -> JSON:
        out: JSON = {
            "recipe": self.recipe,
            "chosen": self.chosen,
            "grid": [[lr, value] for lr, value in self.grid],
        }
        if self.excluded is not None:
            out["excluded"] = dict(self.excluded)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LrChoice:
        what = "a learning-rate choice"
        grid = tuple((lr, _num(value)) for lr, value in _need(d, "grid", what))
        excluded = d.get("excluded")
        return cls(
            _need(d, "recipe", what),
            _need(d, "chosen", what),
            grid,
            dict(excluded) if excluded is not None else None,
        )


@dataclass(frozen=True)
class Convergence:
    """One arm's convergence over its seeds (``kit.convergence_record``): how many of the
    ``seeds`` converged, each seed's best and last step, and each seed's validation curve
    ({seed: ((step, value), ...)})."""

    converged: int
    seeds: int
    best_steps: tuple[int | None, ...]
    last_steps: tuple[int, ...]
    val_history: Mapping[str, tuple[tuple[int, float], ...]]

    def to_json(self) -> JSON:
        return {
            "converged": self.converged,
            "seeds": self.seeds,
            "best_steps": list(self.best_steps),
            "last_steps": list(self.last_steps),
            "val_history": {
                s: [[step, value] for step, value in curve] for s, curve in self.val_history.items()
            },
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Convergence:
        what = "an arm's convergence"
        return cls(
            _need(d, "converged", what),
            _need(d, "seeds", what),
            tuple(_need(d, "best_steps", what)),
            tuple(_need(d, "last_steps", what)),
            {
                s: tuple((step, _num(value)) for step, value in curve)
                for s, curve in _need(d, "val_history", what).items()
            },
        )


@dataclass(frozen=True)
class RecipeRate:
    """A recipe's learning rate without a grid: its paper rate and the study's multiple of it."""

    paper: float
    study: float

    def to_json(self) -> JSON:
        return {"paper": self.paper, "study": self.study}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RecipeRate:
        return cls(_need(d, "paper", "a learning rate"), _need(d, "study", "a learning rate"))


@dataclass(frozen=True)
class DoseChoice:
    """A control's dose chosen on the pilot's scan (``declare.choose_dose``): the claim's size
    it must reach (``target``), the scan's mean effect per dose ({dose text: mean}), the chosen
    ``dose`` (None: no dose reached the target) and whether it ``calibrated``;
    ``per_seed``: the scan's effects per dose and pilot seed ({dose text: {seed text: effect}},
    from which the control's seeds are planned; empty in an older record)."""

    target: float
    scan: Mapping[str, float]
    dose: float | None
    calibrated: bool
    per_seed: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_json(self) -> JSON:
        out: JSON = {
            "target": self.target,
            "scan": dict(self.scan),
            "dose": self.dose,
            "calibrated": self.calibrated,
        }
        if self.per_seed:
            out["per_seed"] = {d: dict(v) for d, v in self.per_seed.items()}
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DoseChoice:
        what = "a control's dose choice"
        return cls(
            _num(_need(d, "target", what)),
            {k: _num(v) for k, v in _need(d, "scan", what).items()},
            _need(d, "dose", what),
            _need(d, "calibrated", what),
            {k: {s: _num(x) for s, x in v.items()} for k, v in d.get("per_seed", {}).items()},
        )


def _choice_or_none(d: Mapping[str, Any] | None) -> DoseChoice | None:
    return DoseChoice.from_json(d) if d is not None else None


@dataclass(frozen=True)
class ControlRecord:
    """The study's calibrated control: ``what`` its handicap does (with "{dose}"; None: no
    control), the ``dose`` trained, the ``doses_scanned`` by a pilot and the pilot's ``choice``
    (None: the declared dose, no scan ran)."""

    what: str | None
    dose: float | None
    doses_scanned: tuple[float, ...]
    choice: DoseChoice | None

    def to_json(self) -> JSON:
        return {
            "what": self.what,
            "dose": self.dose,
            "doses_scanned": list(self.doses_scanned),
            "choice": self.choice.to_json() if self.choice is not None else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ControlRecord:
        what = "the study's control"
        return cls(
            _need(d, "what", what),
            _need(d, "dose", what),
            tuple(_need(d, "doses_scanned", what)),
            _choice_or_none(_need(d, "choice", what)),
        )


@dataclass(frozen=True)
class MeasuredControlRecord:
    """A control applied when measuring (``declare.MeasuredControl``): ``what`` it does, the
    ``claims`` it controls, the ``dose`` used, the doses a pilot scans and the pilot's
    ``choice``."""

    what: str
    claims: tuple[str, ...]
    dose: float
    doses_scanned: tuple[float, ...]
    choice: DoseChoice | None

    def to_json(self) -> JSON:
        return {
            "what": self.what,
            "claims": list(self.claims),
            "dose": self.dose,
            "doses_scanned": list(self.doses_scanned),
            "choice": self.choice.to_json() if self.choice is not None else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MeasuredControlRecord:
        what = "a measured control"
        return cls(
            _need(d, "what", what),
            tuple(_need(d, "claims", what)),
            _need(d, "dose", what),
            tuple(_need(d, "doses_scanned", what)),
            _choice_or_none(d.get("choice")),
        )


_POWER_KEYS = frozenset(
    "per_claim seeds max_seeds pilot_seeds pilot_seed_base out_of_budget pilot_wall_s controls".split()
)


@dataclass(frozen=True)
class PowerPlan:
    """The study's plan from its pilot (``--power``): each tested claim's ``PlanRecord`` (an
    older record: its planned seeds only, an int, or None), the seeds used and their cap, the
    pilot's number of seeds and seed base (None: an older record without it), the claims
    underpowered by plan and the pilot's wall time; ``controls``: the seeds each calibrated
    control needs to separate (``rules.plan_control``), keyed by the claim it calibrates (empty
    in an older record); ``extra`` keeps an older record's other keys."""

    per_claim: Mapping[str, PlanRecord | int | None]
    seeds: int
    max_seeds: int
    pilot_seeds: int
    out_of_budget: tuple[str, ...]
    pilot_wall_s: float
    pilot_seed_base: int | None = None
    controls: Mapping[str, PlanRecord] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> JSON:
        out: JSON = {
            "per_claim": {
                k: p.to_json() if isinstance(p, PlanRecord) else p
                for k, p in self.per_claim.items()
            },
            "seeds": self.seeds,
            "max_seeds": self.max_seeds,
            "pilot_seeds": self.pilot_seeds,
        }
        if self.pilot_seed_base is not None:
            out["pilot_seed_base"] = self.pilot_seed_base
        out["out_of_budget"] = list(self.out_of_budget)
        out["pilot_wall_s"] = self.pilot_wall_s
        if self.controls:
            out["controls"] = {k: p.to_json() for k, p in self.controls.items()}
        return out | dict(self.extra)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PowerPlan:
        what = "the study's power plan"
        per_claim = {
            k: PlanRecord.from_json(p) if isinstance(p, Mapping) else p
            for k, p in _need(d, "per_claim", what).items()
        }
        return cls(
            per_claim=per_claim,
            seeds=_need(d, "seeds", what),
            max_seeds=_need(d, "max_seeds", what),
            pilot_seeds=_need(d, "pilot_seeds", what),
            out_of_budget=tuple(_need(d, "out_of_budget", what)),
            pilot_wall_s=_need(d, "pilot_wall_s", what),
            pilot_seed_base=d.get("pilot_seed_base"),
            controls={k: PlanRecord.from_json(p) for k, p in d.get("controls", {}).items()},
            extra=_extra(d, _POWER_KEYS),
        )


#: a step-0 start as recorded (``kit.start_record``, or a study's own trainer's): JSON, open
Start = Mapping[str, Any]

_STUDY_KEYS = frozenset(
    (
        "name",
        "declared",
        "own_trainer",
        "paper",
        "setup",
        "preconditions",
        "notes",
        "rule",
        "claims",
        "verdict",
        "holds",
        "lr_choice",
        "lr_grid",
        "seeds",
        "seed_base",
        "steps",
        "data",
        "quick",
        "arms",
        "arms_metric",
        "values",
        "loss_history",
        "convergence",
        "learning_rates",
        "lr_scale",
        "max_steps",
        "control",
        "measured_controls",
        "starts",
        "starts_fired",
        "figures",
        "tables",
        "wall_s",
        "power_plan",
        "markdown",
        "command",
    )
)


@dataclass(frozen=True)
class StudyResult:
    """One study's result (``declare.run_declared``, ``declare.run_own``; ``runner.run_study``
    adds the ``command``). A field that is None is absent from the JSON (an older record, or a
    part the study does not have).

    name, paper, setup, notes, rule, preconditions
                          the study, the paper's claim, the setup, what the measure means, the
                          verdict rule, the preconditions in words
    claims, verdict, holds
                          the decided claims, the verdicts in one line, whether every claim holds
    lr_choice, lr_grid    each arm's learning rate chosen on validation, and the grid
    learning_rates, lr_scale
                          the recipes' paper and study rates without a grid
    seeds, seed_base, steps, data, quick, max_steps
                          the run's seeds, budget, data spec, smoke flag, longest extension
    arms, arms_metric     per arm, per seed (text): the test value of the study's metric, its name
    values, loss_history  a study with its own trainer: every run's values and (step, loss) curve
    convergence           per arm: how many seeds converged, best and last steps, curves
    control, measured_controls
                          the calibrated control and the controls applied when measuring
    starts, starts_fired  per arm, per seed: the step-0 start; the warnings that fired
    figures, tables, markdown
                          the page's figures, extra tables and the body (``page.study_body``)
    wall_s, power_plan, command
                          the wall time, the pilot's plan, the command that ran it
    declared, own_trainer a declared study's flags (None in older records)
    extra                 keys of an older record this one does not know, kept as read
    """

    name: str
    paper: str
    setup: str
    claims: tuple[ClaimResult, ...]
    verdict: str
    holds: bool
    notes: str = ""
    rule: str = ""
    declared: bool | None = None
    own_trainer: bool | None = None
    preconditions: tuple[str, ...] | None = None
    lr_choice: Mapping[str, LrChoice] = field(default_factory=dict)
    lr_grid: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()
    seed_base: int | None = None
    steps: int = 0
    data: str = ""
    quick: bool | None = None
    arms: Mapping[str, Mapping[str, float | None]] | None = None
    arms_metric: str | None = None
    values: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None
    loss_history: Mapping[str, Mapping[str, tuple[tuple[float, ...], ...]]] | None = None
    convergence: Mapping[str, Convergence] | None = None
    learning_rates: Mapping[str, RecipeRate] | None = None
    lr_scale: float | None = None
    max_steps: int | None = None
    control: ControlRecord | None = None
    measured_controls: tuple[MeasuredControlRecord, ...] | None = None
    starts: Mapping[str, Mapping[str, Start]] | None = None
    starts_fired: tuple[str, ...] | None = None
    figures: tuple[str, ...] = ()
    tables: str | None = None
    wall_s: float = 0.0
    power_plan: PowerPlan | None = None
    markdown: str = ""
    command: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> JSON:
        """The JSON the studies write (``study.json``), key for key, in their order."""
        own = bool(self.own_trainer)
        entries: list[tuple[str, Any]] = [
            ("name", self.name),
            ("declared", self.declared),
            ("own_trainer", self.own_trainer),
            ("paper", self.paper),
            ("setup", self.setup),
            ("preconditions", _list(self.preconditions)),
            ("notes", self.notes),
            ("rule", self.rule),
            ("claims", [c.to_json() for c in self.claims]),
            ("verdict", self.verdict),
            ("holds", self.holds),
            ("lr_choice", {k: c.to_json() for k, c in self.lr_choice.items()}),
            ("lr_grid", list(self.lr_grid)),
            ("seeds", list(self.seeds)),
            ("seed_base", self.seed_base),
            ("steps", self.steps),
            ("data", self.data),
            ("quick", self.quick),
            ("arms", _nested(self.arms)),
        ]
        if own:
            entries += self._own_entries()
        entries += [
            ("convergence", _records(self.convergence)),
            ("learning_rates", _records(self.learning_rates)),
            ("lr_scale", self.lr_scale),
            ("max_steps", self.max_steps),
            ("control", self.control.to_json() if self.control is not None else None),
            (
                "measured_controls",
                [m.to_json() for m in self.measured_controls]
                if self.measured_controls is not None
                else None,
            ),
            ("starts", _nested(self.starts)),
            ("starts_fired", _list(self.starts_fired)),
            ("figures", list(self.figures)),
        ]
        if not own:
            entries += self._own_entries() + [("tables", self.tables)]
        entries += [("wall_s", self.wall_s)]
        if own:
            entries.append(("tables", self.tables))
        entries += [
            ("power_plan", self.power_plan.to_json() if self.power_plan is not None else None),
            ("markdown", self.markdown),
            ("command", self.command),
        ]
        return {k: v for k, v in entries if v is not None} | dict(self.extra)

    def _own_entries(self) -> list[tuple[str, Any]]:
        loss = (
            {
                label: {s: [list(h) for h in curve] for s, curve in runs.items()}
                for label, runs in self.loss_history.items()
            }
            if self.loss_history is not None
            else None
        )
        return [
            ("arms_metric", self.arms_metric),
            ("values", _nested(self.values)),
            ("loss_history", loss),
        ]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StudyResult:
        """A ``study.json`` read back; an older one's missing keys are None (absent), its keys
        this record does not know are kept in ``extra``. A file without the keys every study
        result has is one ``InputError`` naming the key."""
        what = f"study.json of {d.get('name')!r}" if isinstance(d, Mapping) else "study.json"

        def need(key: str) -> Any:
            return _need(d, key, what)

        def records(key: str, make: Any) -> Any:
            value = d.get(key)
            return None if value is None else {k: make(v) for k, v in value.items()}

        measured = d.get("measured_controls")
        loss = d.get("loss_history")
        return cls(
            name=need("name"),
            paper=need("paper"),
            setup=need("setup"),
            claims=tuple(ClaimResult.from_json(c) for c in need("claims")),
            verdict=need("verdict"),
            holds=need("holds"),
            notes=need("notes"),
            rule=need("rule"),
            declared=d.get("declared"),
            own_trainer=d.get("own_trainer"),
            preconditions=_tuple(d.get("preconditions")),
            lr_choice={k: LrChoice.from_json(c) for k, c in need("lr_choice").items()},
            lr_grid=tuple(need("lr_grid")),
            seeds=tuple(need("seeds")),
            seed_base=d.get("seed_base"),
            steps=need("steps"),
            data=need("data"),
            quick=d.get("quick"),
            arms=d.get("arms"),
            arms_metric=d.get("arms_metric"),
            values=d.get("values"),
            loss_history=(
                {
                    label: {s: tuple(tuple(h) for h in curve) for s, curve in runs.items()}
                    for label, runs in loss.items()
                }
                if loss is not None
                else None
            ),
            convergence=records("convergence", Convergence.from_json),
            learning_rates=records("learning_rates", RecipeRate.from_json),
            lr_scale=d.get("lr_scale"),
            max_steps=d.get("max_steps"),
            control=ControlRecord.from_json(d["control"]) if d.get("control") is not None else None,
            measured_controls=(
                tuple(MeasuredControlRecord.from_json(m) for m in measured)
                if measured is not None
                else None
            ),
            starts=d.get("starts"),
            starts_fired=_tuple(d.get("starts_fired")),
            figures=tuple(need("figures")),
            tables=d.get("tables"),
            wall_s=need("wall_s"),
            power_plan=(
                PowerPlan.from_json(d["power_plan"]) if d.get("power_plan") is not None else None
            ),
            markdown=need("markdown"),
            command=d.get("command"),
            extra=_extra(d, _STUDY_KEYS),
        )


def _list(values: Sequence[Any] | None) -> list[Any] | None:
    return list(values) if values is not None else None


def _tuple(values: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return tuple(values) if values is not None else None


def _nested(value: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """A two-level mapping as plain dicts (its leaves as they are)."""
    return None if value is None else {k: dict(v) for k, v in value.items()}


def _records(value: Mapping[str, Any] | None) -> dict[str, JSON] | None:
    return None if value is None else {k: r.to_json() for k, r in value.items()}


__all__ = [
    "ClaimResult",
    "ControlRecord",
    "Convergence",
    "DecisionInputs",
    "DoseChoice",
    "LrChoice",
    "MeasuredControlRecord",
    "PlanRecord",
    "PowerPlan",
    "RecipeRate",
    "Start",
    "StudyResult",
    "interval_from_json",
    "interval_to_json",
]
