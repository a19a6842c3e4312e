"""A study as a declaration, and the one runner that runs any of them.

A study file under ``curvalign_lab/studies/`` defines ``STUDY``, a ``Study``: its claims (the
paper's words and effect, with the seed file's section, the kind of test and its margin), its
arms (recipe and options), the control's handicap as data (what it does, the doses a pilot
scans, and the function that applies one to a store), its baselines and preconditions in words,
and ``measure``, which turns the trained arms into each claim's per-seed effect (and, where the
claim is about a test metric, the per-item totals of the two rows it compares). ``run_declared``
trains every arm through ``kit.Bench`` (the shared ``fit``), applies the decision rules
(``rules``, ``kit.decide``, Holm) and writes ``study.json`` and ``study.md``. A ``Study`` whose
arms are not recipes on a feature store (one embedding per node of a graph) gives its own arm
trainer (``Study.trainer``, an ``ArmTrainer``: load its world, train one arm with one seed,
handicap the world by a dose); ``run_own`` then takes the same steps without ``kit.Bench``. Arms
that change their data mid-run or are measured during training declare it (``Phases``,
``During``).

Adding a study is writing one file: ``studies.registry()`` finds it. Optional parts of a
``Study``: ``metric`` (the claims' test metric path, e.g. "zeroshot/top1", where it is not mean
R@1: the control's effect, the arms table and ``Trained.difference`` read it), ``report`` (extra
Markdown of secondary evidence for the page), ``configure`` with ``quick_options`` (the study
rebuilt from ``--set`` options, e.g. its curvatures) and ``Claim.report_equivalence`` (a
non-inferiority claim also decided as equivalence within its margin).

The declared runner, step by step (``run_declared``):

1. ``quick``: the study's tiny store, 2 seeds, its few quick steps, no learning-rate grid, no
   pilot (a smoke run: every claim then says "no plan", never "underpowered").
2. ``power``: a *pilot* on the disjoint seed base ``seed_base + PILOT_OFFSET`` trains every arm
   and the control at each dose of its handicap's scan; each claim's plan
   (``rules.plan_for_sd``: exact noncentral-t MDE at the paper's effect or at the distance to the
   margin, capped) sets the seeds, and the control's dose is the one whose effect equals the
   claim's size (``rules.dose_for_effect``; none reaches it: the control is reported as unable
   to calibrate, and claims needing it cannot hold). The control's own seeds are planned too,
   at the 80% upper confidence limit of its pilot noise near that dose (``rules.plan_control``):
   the run takes the most seeds any claim or control asks, the cap where a plan is
   underpowered (``plan_on_pilot``).
3. The confirmatory run trains every arm and the control at the chosen dose with the planned
   seeds; ``measure`` gives each claim's per-seed effects; the interval counts the seeds and,
   where ``measure`` gives item totals, the test items too (``stats.two_level_difference``).
4. Each claim is decided (``kit.claim_record`` with its plan), Holm over the tested claims
   (``kit.apply_holm``), and the page written (``page.study_page``). Every arm's step-0 health
   and resolved start are recorded (``starts``) and the page lists any warning that fired.

Optional parts of a declaration (each off by default): ``schedule`` (options every arm gets that
depend on the step budget, e.g. a curriculum in steps), ``During`` (values measured at marks
during training through the shared ``fit``'s trainer hooks, ``kit.ArmHooks``, kept in
``Trained.during``), ``select_best`` (False: the arms' last weights), ``admissible`` (the claims'
precondition per learning rate: the rate is chosen among the rates where it holds,
``Bench.choose_lr``), ``Handicap.options`` (a handicap of the training rather than of the data),
``Control.effect`` (a control measured on the claims' own statistic rather than on mean R@1),
``tables`` (extra Markdown for the page) and ``figures``.

Optional parts a study may declare (each a field with a default; a study without them runs as
above):

* ``Study.phases`` (``Phases``): a run in phases whose claim compares the model at a mark (e.g.
  the end of Phase 1) with the end of the run: the arms' budget-dependent options, the marks,
  a ``probe`` measured at each mark and at the end (``Trained.probes``), the validation value
  and whether the last weights are kept. The control's handicapped store can start at a step
  (``Handicap.start``, e.g. forced forgetting from the Phase-1 end on) and its effect can be
  measured on the claim's own metric (``Control.metric``).
* ``Study.measured_controls`` (``MeasuredControl``): a control applied when measuring, not when
  training (e.g. a share of a composed query's factors taken from a wrong partner); the pilot
  scans its doses on the trained arms and picks, as for ``Control``, the dose whose effect
  equals the calibrated claim's size; the claims it names use it instead of the study's control.
* ``Measured.interval``: an interval the measure computed itself (e.g. a two-level bootstrap of
  a statistic that is not a sum over test items, such as a Spearman correlation).
* ``Claim.report_equivalence``: a superiority or non-inferiority claim whose test is not
  significant also reports equivalence within ±``margin`` (TOST).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError
from curvalign.recipes.base import Recipe
from curvalign.stats import Interval, ItemTotals, mean_interval
from curvalign_lab import kit, rules
from curvalign_lab.records import (
    ClaimResult,
    ControlRecord,
    DoseChoice,
    LrChoice,
    MeasuredControlRecord,
    PlanRecord,
    PowerPlan,
    RecipeRate,
    StudyResult,
)

if TYPE_CHECKING:
    from curvalign.eval.pipeline import Evaluation
    from curvalign.eval.result import EvaluationResult
    from curvalign.recipes.base import Recipe

Notify = Callable[[str], None]
#: the world a study's own trainer loads (``ArmTrainer``)
W = TypeVar("W")

#: the pilot's seed base is the confirmatory one plus this: disjoint from bases 0, 100 and 200
PILOT_OFFSET = 1000
#: rounds in which a pilot measures its control at the dose read off its scan and reads the dose
#: again with that point (``run_declared``)
DOSE_REFINEMENTS = 1
#: the smoke run's store (``--quick``): a tiny synthetic world
QUICK_DATA = "synthetic:images=120,text_pairs=0,captions_max=3,val_fraction=0.25"
#: the smoke world of studies about a taxonomy (a small taxonomy; each study adds what it needs)
QUICK_WORLD = "synthetic:images=160,text_pairs=60,captions_max=3,depth=2,branching=2,templates=2"
QUICK_SEEDS = 2
QUICK_STEPS = 6
QUICK_OVERRIDES = ("batch_size=16", "pair_batch_size=16")


@dataclass(frozen=True)
class Claim:
    """One claim of a paper, as data.

    key         a short identifier (the measure's output is keyed by it)
    statement   what the study measures, one line (the verdict table's claim column)
    words       the paper's words, quoted
    source      the seed file and section the words and the effect come from
    effect      the paper's effect on the study's metric, in the metric's units (a fraction for
                R@1: 0.02 is 2 points); None: the paper gives no number
    kind        ``rules.SUPERIORITY`` (effect > 0), ``NON_INFERIORITY`` (effect > -margin) or
                ``EQUIVALENCE`` (|effect| < margin, TOST)
    margin      the margin of a non-inferiority or equivalence claim
    role        "primary" / "secondary" / "exploratory" (tested, in the Holm family) or
                "precondition" / "regime" (decided outside the family)
    min_steps   the budget below which the claim cannot be tested ("too short")
    report_equivalence
                a superiority or non-inferiority claim also decided as equivalence within
                ±margin (TOST) where its test is not significant (an "almost constant" claim)
    """

    key: str
    statement: str
    words: str
    source: str
    effect: float | None
    kind: str = rules.SUPERIORITY
    margin: float | None = None
    role: str = "primary"
    unit: str = "points"
    scale: float = 100.0
    min_steps: int = 0
    #: also report equivalence within ±margin (TOST) when the test is not significant
    report_equivalence: bool = False

    def __post_init__(self) -> None:
        if self.kind not in rules.KINDS:
            raise ConfigError(f"claim {self.key}: kind must be one of {rules.KINDS}")
        if self.kind != rules.SUPERIORITY and self.margin is None:
            raise ConfigError(f"claim {self.key}: a {self.kind} claim needs its margin")
        if self.report_equivalence and self.margin is None:
            raise ConfigError(f"claim {self.key}: reporting equivalence needs its margin")

    @property
    def threshold(self) -> float:
        return -abs(self.margin) if self.kind == rules.NON_INFERIORITY and self.margin else 0.0

    @property
    def size(self) -> float:
        """The effect a calibrated control must show: the paper's effect (superiority) or the
        margin (a margin claim); 0 without either."""
        if self.kind != rules.SUPERIORITY:
            return abs(self.margin or 0.0)
        return abs(self.effect) if self.effect is not None else 0.0


@dataclass(frozen=True)
class Arm:
    """One arm: a ``label``, the ``recipe`` it trains and its config ``options``."""

    label: str
    recipe: str
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Handicap:
    """A control's handicap as data: ``what`` it does (one line, with "{dose}" where the dose
    goes), the ``doses`` a pilot scans, the ``dose`` used without a scan, and ``apply(store,
    dose, seed)`` that returns the handicapped training store (None where the study's own
    trainer handicaps its world, ``ArmTrainer.handicap``). ``options(dose, steps)``: the
    options the dose adds to the clean arm's (after them), for a handicap of the training rather
    than of the data (``apply`` may then return the store unchanged); ``start(steps)``: the step
    from which the control trains on it at a budget of ``steps`` (None: from step 0), e.g.
    forced forgetting from the end of Phase 1 on."""

    what: str
    doses: tuple[float, ...]
    dose: float
    #: None for a study with its own trainer (``ArmTrainer.handicap`` applies the dose)
    apply: Callable[[FeatureStore, float, int], FeatureStore] | None = None
    options: Callable[[float, int], tuple[str, ...]] | None = None
    start: Callable[[int], int] | None = None

    def text(self, dose: float) -> str:
        return self.what.format(dose=f"{dose:.3g}")


#: the seed of the one label-noise draw every seed of a control trains on (``label_noise``)
NOISE_DRAW = 0


def label_noise(
    what: str = "{dose} of the train captions moved to another image (one draw for every seed)",
    draw: int | None = NOISE_DRAW,
) -> Callable[[tuple[float, ...], float], Handicap]:
    """A label-noise ``Handicap`` factory: ``label_noise()(doses, dose)``.

    ``draw``: the seed of the one corruption (``kit.with_label_noise``) that every seed's
    control trains on, the pilot's scan included. With common random numbers the control
    differs from its clean arm by the same handicap on every seed, so its seed-to-seed spread
    is training's alone, like the claim's, and the pilot calibrates the very corruption the
    confirmatory run trains on; the shares are nested (a larger dose moves the captions of the
    smaller one and more). ``None``: a fresh draw per run seed, whose spread adds the draw's
    own (``benchmarks/label_noise_draw.py`` measures both)."""

    def apply(store: FeatureStore, dose: float, seed: int) -> FeatureStore:
        return kit.with_label_noise(store, dose, seed if draw is None else draw)

    def make(doses: tuple[float, ...], dose: float) -> Handicap:
        return Handicap(what, doses, dose, apply)

    return make


@dataclass(frozen=True)
class Control:
    """The calibrated positive control: ``arm`` (the clean arm) trained with ``handicap``; its
    effect (clean - handicapped, on the claims' metric) must separate with at least the size of
    claim ``claim`` (``Claim.size``). ``effect(trained, label, seed)``: the control's effect on
    one seed, oriented so that the handicap shows as a positive number, from the trained arms
    and the control's own runs under ``label`` (None: clean - handicapped test mean R@1). ``metric(trained, label, seed)``: instead, the
    per-run value the effect is measured on, e.g. the change of a skill between two marks
    (``Phases``), oriented so that the handicap lowers it."""

    arm: str
    handicap: Handicap
    claim: str
    effect: Callable[[Trained, str, int], float] | None = None
    metric: Callable[[Trained, str, int], float] | None = None


@dataclass(frozen=True)
class During:
    """Values measured during training, through the shared ``fit``'s trainer hooks (the marks
    of ``kit.ArmHooks``): ``marks(steps)`` the steps to measure at for a budget of ``steps`` (a
    mark at or past the budget: the last step, after any plateau extension), ``measure(bench,
    model)`` the values recorded there (hooks run with the model in eval mode and gradients
    off, so measuring cannot change the training). ``Trained.during[arm][seed][mark]`` holds
    them, for every arm and for the control."""

    marks: Callable[[int], tuple[int, ...]]
    measure: Callable[[kit.Bench, Recipe], Mapping[str, float]]


@dataclass
class Measured:
    """One claim measured: ``effect`` per seed (oriented: the claim says effect > threshold);
    ``items`` the per-seed item totals of the two rows it compares (a, b), for an interval over
    seeds and test items; ``precondition`` / ``regime``: why it cannot be tested here (None:
    it can); ``note``: a measured bound or remark for the page; ``interval``: the claim's
    interval where the measure computed it itself (e.g. over seeds and test items for a
    statistic that is not a sum over items; None: ``claim_interval`` computes it)."""

    effect: dict[int, float]
    items: tuple[Sequence[ItemTotals], Sequence[ItemTotals]] | None = None
    precondition: str | None = None
    regime: str | None = None
    note: str = ""
    interval: Interval | None = None


def metric_value(result: EvaluationResult, metric: str | None) -> float:
    """One evaluation's value of a study's ``metric``: mean R@1 when None, else the numeric
    leaf at the metric path (e.g. "zeroshot/top1"); nan where the evaluation has none."""
    if metric is None:
        return kit.mean_r1(result)
    value = result.metric(metric, math.nan)
    return math.nan if value is None else float(value)


@dataclass
class Trained:
    """What ``measure`` receives: the bench, every arm's runs and test evaluations per seed;
    with ``Study.phases``, ``probes[label][seed][mark]`` (the probe's values at each named mark
    and at "end") and the synthetic ``world`` the store came from (None for a stored one);
    ``metric`` the study's metric path (``Study.metric``; None: mean R@1); a study with its own
    trainer: its runs in ``own``."""

    bench: kit.Bench
    seeds: list[int]
    runs: dict[str, dict[int, kit.ArmResult]] = field(default_factory=dict)
    evals: dict[str, dict[int, Evaluation]] = field(default_factory=dict)
    #: ``During``'s values: arm (or control) label -> seed -> mark -> {name: value}
    during: dict[str, dict[int, dict[int, dict[str, float]]]] = field(default_factory=dict)
    #: the control's test value of the study's metric: label -> seed -> value
    control_r1: dict[str, dict[int, float]] = field(default_factory=dict)
    probes: dict[str, dict[int, dict[str, dict[str, Any]]]] = field(default_factory=dict)
    world: Any = None
    metric: str | None = None
    #: a study with its own trainer (``Study.trainer``): every arm's runs per seed; such a
    #: study has no bench (``bench`` is None there) and no ``runs`` / ``evals``
    own: dict[str, dict[int, OwnRun]] = field(default_factory=dict)

    def value(self, arm: str) -> dict[int, float]:
        """Per seed: the arm's test value of the study's metric (``r1`` when it has none)."""
        return {s: metric_value(ev.metrics, self.metric) for s, ev in self.evals[arm].items()}

    def item_totals(self, arm: str) -> list[ItemTotals]:
        """Per seed (in ``seeds`` order): the arm's per-item totals of the study's metric:
        ``totals`` of mean R@1 when it has none, else the evaluation's per-item hits of the
        metric path (``Evaluation.hits``, e.g. one 0/1 per labelled test image)."""
        if self.metric is None:
            return self.totals(arm)
        out = []
        for s in self.seeds:
            hits = self.evals[arm][s].hits.get(self.metric)
            if hits is None:
                raise ConfigError(f"arm {arm}: its evaluation kept no per-item {self.metric!r}")
            out.append(ItemTotals.from_values(hits.double().cpu().tolist()))
        return out

    def r1(self, arm: str) -> dict[int, float]:
        """Per seed: the arm's test mean R@1 (mean of T2I and I2T R@1)."""
        return {s: kit.mean_r1(ev.metrics) for s, ev in self.evals[arm].items()}

    def totals(self, arm: str, metric: str = "mean@1") -> list[ItemTotals]:
        """Per seed (in ``seeds`` order): the arm's per-item totals on ``metric``."""
        out = []
        for s in self.seeds:
            items = self.evals[arm][s].items
            if items is None:
                raise ConfigError(f"arm {arm}: its evaluation kept no per-item results")
            out.append(items.totals(metric))
        return out

    def difference(self, a: str, b: str) -> Measured:
        """The common measure: the study's metric (mean R@1 without one) of ``a`` - ``b`` per
        seed, with its item totals."""
        ra, rb = self.value(a), self.value(b)
        return Measured(
            {s: ra[s] - rb[s] for s in self.seeds},
            items=(self.item_totals(a), self.item_totals(b)),
        )


@dataclass
class OwnRun:
    """One arm trained with one seed by a study's own trainer (``ArmTrainer.train``): its
    measures (``values``, e.g. {"map": ..., "mean_rank": ...}), its start in the shape of
    ``kit.start_record`` (``checked``, ``warnings`` [{code, message}], ``radius``,
    ``curvature_radius2``, ...), its (step, loss) ``history`` and the ``steps`` it trained."""

    values: dict[str, float]
    start: dict[str, Any]
    history: list[tuple[int, float]] = field(default_factory=list)
    steps: int = 0


@dataclass(frozen=True)
class ArmTrainer(Generic[W]):
    """A study's own arm trainer, for arms that are not recipes on a feature store (e.g. one
    embedding per node of a graph, trained from its edges). ``run_declared`` hands such a study
    to ``run_own``: the same quick / pilot / plan / dose scan / confirmatory steps, claims
    decided by ``decide_claims``, with these in place of ``kit.Bench``:

    load(data)                          the world (``W``) of a data spec (``Study.data``)
    train(train_world, test_world, arm, overrides, seed, steps, notify) -> OwnRun
                                        one arm, one seed: trained on ``train_world``,
                                        measured on ``test_world`` (the clean one)
    handicap(world, dose, seed)         the control's handicapped training world
    score                               the key of ``OwnRun.values`` that the learning-rate
                                        choice maximises and the control's effect (clean -
                                        handicapped) is measured on
    table(trained)                      the page's table of the arms (optional)
    metric                              the arms table's name for ``score``

    A learning-rate grid (``lr_grid``, not in a smoke run) is walked per arm as ``kit.climb_grid``
    does, on ``score`` with ``kit.TUNE_SEED``; the arm then trains with ``lr=CHOSEN``."""

    load: Callable[[str], W]
    train: Callable[[W, W, Arm, Sequence[str], int, int, Notify], OwnRun]
    handicap: Callable[[W, float, int], W]
    score: str
    table: Callable[[Trained], str] | None = None
    metric: str = "score"


@dataclass(frozen=True)
class Phases:
    """Training in phases (module docstring), for every arm and the control.

    options(steps)   extra options of every arm at a budget of ``steps`` (e.g. the step of the
                     phase switch), after the arm's own
    marks(steps)     {name: step}: where ``probe`` measures each run during training
    probe(recipe, world)   the values measured at each mark and, on the final weights, at "end"
                     (``Trained.probes``); ``world``: the synthetic world (None: a stored one)
    validate(recipe, store, world)   the validation value (None: validation mean R@1)
    select_best      False: each run keeps its last weights (a claim about the end of the run)
    """

    marks: Callable[[int], Mapping[str, int]]
    probe: Callable[[Recipe, Any], dict[str, Any]]
    options: Callable[[int], tuple[str, ...]] = lambda steps: ()
    validate: Callable[[Recipe, FeatureStore, Any], float] | None = None
    select_best: bool = False


@dataclass(frozen=True)
class MeasuredControl:
    """A control applied when measuring, not when training: ``effect(trained, dose)`` gives its
    per-seed effect at a dose (oriented: the handicap shows as a positive difference) on the
    trained arms; ``what`` (with "{dose}"), the ``doses`` a pilot scans and the ``dose`` used
    without a scan as in ``Handicap``. It is calibrated on claim ``claim`` (its size, as for
    ``Control``) and is the control of every claim in ``claims`` (``claim`` among them)."""

    claim: str
    claims: tuple[str, ...]
    what: str
    doses: tuple[float, ...]
    dose: float
    effect: Callable[[Trained, float], dict[int, float]]

    def text(self, dose: float) -> str:
        return self.what.format(dose=f"{dose:.3g}")


@dataclass(frozen=True)
class Study:
    """A declared study (module docstring)."""

    name: str
    paper: str
    claims: tuple[Claim, ...]
    arms: tuple[Arm, ...]
    measure: Callable[[Trained], Mapping[str, Measured]]
    control: Control | None = None
    data: str = "synthetic:images=2500,val_fraction=0.2,text_pairs=0"
    steps: int = 150
    validations: int = 3
    prepare: Callable[[FeatureStore], FeatureStore] | None = None
    baselines: tuple[str, ...] = ()
    preconditions: tuple[str, ...] = ()
    notes: str = ""
    quick_data: str = QUICK_DATA
    quick_steps: int = QUICK_STEPS
    #: overrides of the smoke run only (e.g. a narrower MLP), after the arms' own
    quick_overrides: tuple[str, ...] = ()
    #: options every arm and the control get from the step budget (before the arm's own)
    schedule: Callable[[int], tuple[str, ...]] | None = None
    #: values measured during training (``During``), for ``measure`` and ``Control.effect``
    during: During | None = None
    #: the arms' model: the best validation weights (True) or the last ones
    select_best: bool = True
    #: the claims' precondition per learning rate: ``admissible(bench)(model)`` is None where it
    #: holds, else why not; the rate is chosen among the rates where it holds and each excluded
    #: rate is kept with its reason (``Bench.choose_lr``, the result's ``lr_choice``)
    admissible: Callable[[kit.Bench], Callable[[Recipe], str | None]] | None = None
    #: extra Markdown for the page (tables of what was measured) from the trained arms
    tables: Callable[[Trained, Mapping[str, Measured]], str] | None = None
    #: the page's figures: ``figures(trained, out)`` writes them into ``out``, returns the paths
    figures: Callable[[Trained, Path], Sequence[Path]] | None = None
    #: training in phases, measured at marks (``Phases``; None: one phase, no marks)
    phases: Phases | None = None
    #: controls applied when measuring (``MeasuredControl``), each for the claims it names
    measured_controls: tuple[MeasuredControl, ...] = ()
    #: the claims' test metric path (e.g. "zeroshot/top1"): the control's effect, the arms
    #: table and ``Trained.difference`` read it; None: mean R@1
    metric: str | None = None
    #: extra Markdown for the page from the confirmatory arms (secondary evidence, reported and
    #: never decided: e.g. a sanity row or an ordering table); None: none
    report: Callable[[Trained], str] | None = None
    #: the study rebuilt with keyword options (``curvalign study NAME --set KEY=VALUE``; its
    #: parameters are the options); None: a study without options
    configure: Callable[..., Study] | None = None
    #: the options of the smoke run (``--quick``), through ``configure``
    quick_options: Mapping[str, Any] = field(default_factory=dict)
    #: the study's own arm trainer (``ArmTrainer``; ``run_own``): arms that are not recipes
    #: trained on a feature store (None: every arm trains through ``kit.Bench``)
    trainer: ArmTrainer[Any] | None = None

    def __post_init__(self) -> None:
        labels = [a.label for a in self.arms]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"study {self.name}: arm labels must be unique, got {labels}")
        if self.during is not None and self.phases is not None:
            raise ConfigError(
                f"study {self.name}: declare either `during` or `phases` (both measure at marks)"
            )
        if self.control is not None:
            if self.control.effect is not None and self.control.metric is not None:
                raise ConfigError(
                    f"study {self.name}: the control takes either `effect` or `metric`, not both"
                )
            if self.control.arm not in labels:
                raise ConfigError(f"study {self.name}: control arm {self.control.arm!r} unknown")
            if self.control.claim not in {c.key for c in self.claims}:
                raise ConfigError(f"study {self.name}: control claim {self.control.claim!r}")
        keys = {c.key for c in self.claims}
        for mc in self.measured_controls:
            if mc.claim not in mc.claims or not set(mc.claims) <= keys:
                raise ConfigError(
                    f"study {self.name}: measured control claims {mc.claims} (calibrated on "
                    f"{mc.claim!r}) must be claims of the study, the calibrated one among them"
                )

    def claim(self, key: str) -> Claim:
        return next(c for c in self.claims if c.key == key)


def option_names(study: Study) -> set[str]:
    """The ``--set`` options a declared study takes: ``lr_grid`` and ``configure``'s
    parameters."""
    import inspect

    names = {"lr_grid"}
    if study.configure is not None:
        names |= set(inspect.signature(study.configure).parameters)
    return names


def configured(study: Study, options: Mapping[str, Any], quick: bool = False) -> Study:
    """``study`` with its options applied through ``configure`` (``quick``: its smoke run's
    ``quick_options`` first, the given ones winning); ``lr_grid`` is the runner's, not the
    study's. An option the study does not take is one ``ConfigError``."""
    chosen = {**(study.quick_options if quick else {}), **options}
    chosen.pop("lr_grid", None)
    if not chosen:
        return study
    unknown = set(chosen) - option_names(study)
    if study.configure is None or unknown:
        raise ConfigError(
            f"study {study.name} has no option {', '.join(sorted(unknown or set(chosen)))}; "
            f"options: {', '.join(sorted(option_names(study)))}"
        )
    return study.configure(**chosen)


def control_label(study: Study, dose: float) -> str:
    assert study.control is not None
    return f"control: {study.control.arm}, {study.control.handicap.text(dose)}"


def train_arms(
    study: Study,
    bench: kit.Bench,
    seeds: Sequence[int],
    doses: Sequence[float],
    world: Any = None,
) -> tuple[Trained, dict[float, dict[int, float]]]:
    """Every arm with every seed, and the control at each of ``doses``: (the trained arms,
    {dose: {seed: control effect}}), the control effect being clean - handicapped on the
    study's metric (mean R@1 without one), or ``Control.effect``, or the change of
    ``Control.metric``. ``world``: the synthetic world of the store, handed to
    ``Phases.probe`` and kept in ``Trained.world``."""
    from curvalign.eval import run_evaluation

    trained = Trained(bench, list(seeds), world=world, metric=study.metric)
    for arm in study.arms:
        for seed in seeds:
            run = _train_one(study, bench, trained, arm.label, arm.recipe, arm.options, seed)
            trained.evals.setdefault(arm.label, {})[seed] = run_evaluation(
                run.recipe, bench.store, "test", diagnostics=False
            )
    if study.control is None:
        return trained, {}
    return trained, train_control(study, bench, trained, seeds, doses)


def train_control(
    study: Study,
    bench: kit.Bench,
    trained: Trained,
    seeds: Sequence[int],
    doses: Sequence[float],
) -> dict[float, dict[int, float]]:
    """The control at each of ``doses`` with every seed, its runs kept in ``trained`` beside
    the clean arm's (trained already, ``train_arms``): {dose: {seed: control effect}}."""
    assert study.control is not None
    effects: dict[float, dict[int, float]] = {}
    clean_arm = next(a for a in study.arms if a.label == study.control.arm)
    clean = trained.value(clean_arm.label)
    handicap = study.control.handicap
    metric = study.control.metric
    start = handicap.start(bench.steps) if handicap.start is not None else 0
    # the control trains at its clean arm's learning rate: the handicap is the only difference
    clean_choice = bench.lr_choice.get(clean_arm.label)
    chosen = clean_choice.chosen if clean_choice is not None else None
    options = [*clean_arm.options, *([f"lr={chosen:g}"] if chosen is not None else [])]
    if handicap.apply is None:
        raise ConfigError(
            f"study {study.name}: its control's handicap needs apply(store, dose, seed) "
            "(or the study its own trainer, Study.trainer, whose handicap applies the dose)"
        )
    for dose in doses:
        label = control_label(study, dose)
        extra = [*options, *(handicap.options(dose, bench.steps) if handicap.options else ())]
        for seed in seeds:
            handicapped = handicap.apply(bench.store, dose, seed)
            run = _train_one(
                study,
                bench,
                trained,
                label,
                clean_arm.recipe,
                extra,
                seed,
                store_from=_constant(handicapped, start),
            )
            value = metric_value(bench.evaluate(run.recipe), study.metric)
            trained.control_r1.setdefault(label, {})[seed] = value
            if study.control.effect is not None:
                effect = study.control.effect(trained, label, seed)
            elif metric is not None:
                effect = metric(trained, clean_arm.label, seed) - metric(trained, label, seed)
            else:
                effect = clean[seed] - value
            effects.setdefault(dose, {})[seed] = effect
    return effects


def _train_one(
    study: Study,
    bench: kit.Bench,
    trained: Trained,
    label: str,
    recipe: str,
    options: Sequence[str],
    seed: int,
    store_from: Callable[[int], FeatureStore | None] | None = None,
) -> kit.ArmResult:
    """One arm, one seed through ``bench.train``, kept in ``trained.runs``, with the study's
    optional parts: its ``schedule`` options, ``During``'s marks (recorded into
    ``trained.during``) or ``Phases`` (options, marks, probes into ``trained.probes``,
    validation, weights choice), ``select_best`` and its learning-rate precondition
    (``admissible``)."""
    phases, during, world = study.phases, study.during, trained.world
    extra = [
        *(study.schedule(bench.steps) if study.schedule is not None else ()),
        *options,
        *(phases.options(bench.steps) if phases is not None else ()),
    ]
    marks: tuple[int, ...] = ()
    on_mark: Callable[[int, Any], None] | None = None
    val_fn: Callable[[Any], float] | None = None
    select_best = study.select_best
    probes: dict[str, dict[str, Any]] = {}
    if during is not None:
        record = trained.during.setdefault(label, {}).setdefault(seed, {})
        marks = tuple(during.marks(bench.steps))

        def on_mark(step: int, model: Any) -> None:
            record[step] = dict(during.measure(bench, model))

    elif phases is not None:
        phase_marks = dict(phases.marks(bench.steps))
        names = {step: name for name, step in phase_marks.items()}
        probes = trained.probes.setdefault(label, {}).setdefault(seed, {})
        marks = tuple(phase_marks.values())
        select_best = phases.select_best

        def on_mark(step: int, model: Any) -> None:
            probes[names.get(step, "end")] = phases.probe(model, world)

        validate = phases.validate
        if validate is not None:

            def val_fn(model: Any) -> float:
                return validate(model, bench.store, world)

    run = bench.train(
        label,
        recipe,
        extra,
        seed,
        select_best=select_best,
        marks=marks,
        on_mark=on_mark,
        val_fn=val_fn,
        store_from=store_from,
        admissible=study.admissible(bench) if study.admissible is not None else None,
    )
    if phases is not None:
        probes["end"] = phases.probe(run.recipe, world)
    trained.runs.setdefault(label, {})[seed] = run
    return run


def _constant(store: FeatureStore, start: int = 0) -> Callable[[int], FeatureStore | None]:
    """``store_from`` of an arm that trains on ``store`` from step ``start`` on (before it: the
    study's store)."""

    def store_from(step: int) -> FeatureStore | None:
        return store if step >= start else None

    return store_from


def claim_interval(measured: Measured, seeds: Sequence[int]) -> Interval:
    """The claim's interval: over seeds and test items (``two_level_difference``) where the
    measure gave item totals, else the paired t interval over seeds."""
    from curvalign.stats import two_level_difference

    if measured.interval is not None:
        return measured.interval
    values = [measured.effect[s] for s in seeds if s in measured.effect]
    if measured.items is not None and len(values) >= 2:
        a, b = measured.items
        return two_level_difference(a, b, replicates=400)
    return mean_interval(values) if values else Interval(math.nan, math.nan, math.nan, 0)


def plan_study(
    study: Study, pilot: Mapping[str, Measured], pilot_seeds: Sequence[int], cap: int
) -> dict[str, rules.Plan]:
    """Each tested claim's plan from the pilot's per-seed effects (``rules.plan_claim``), at
    the level of the Holm family the tested claims form on the pilot (``apply_holm``'s), with
    the test items' standard error of the pilot's interval where the claim counts its test
    items (``claim_interval``): more seeds do not shrink that share."""
    tested = [
        claim
        for claim in study.claims
        if (m := pilot.get(claim.key)) is not None
        and rules.in_holm_family(claim.role, m.precondition, m.regime)
    ]
    plans = {}
    for claim in tested:
        m = pilot[claim.key]
        values = [m.effect[s] for s in pilot_seeds if s in m.effect]
        item_se = getattr(claim_interval(m, pilot_seeds), "item_se", 0.0)
        plans[claim.key] = rules.plan_claim(
            values,
            kind=claim.kind,
            paper_effect=claim.effect,
            margin=claim.margin,
            cap=cap,
            family=len(tested),
            item_se=item_se,
        )
    return plans


def choose_dose(study: Study, effects: Mapping[float, Mapping[int, float]]) -> DoseChoice:
    """The control's dose from the pilot's scan (``rules.dose_for_effect``): the dose whose mean
    effect equals the size of the claim it calibrates; the scan itself is kept."""
    assert study.control is not None
    return _dose_choice(study.claim(study.control.claim).size, effects)


def _dose_choice(target: float, effects: Mapping[float, Mapping[int, float]]) -> DoseChoice:
    """``choose_dose`` for a target size: the scan's means and the dose that reaches it."""
    doses = sorted(effects)
    means = [sum(effects[d].values()) / max(1, len(effects[d])) for d in doses]
    dose = rules.dose_for_effect(doses, means, target) if doses else None
    return DoseChoice(
        target=target,
        scan={f"{d:g}": m for d, m in zip(doses, means, strict=True)},
        dose=dose,
        calibrated=dose is not None,
        per_seed={f"{d:g}": {str(s): v for s, v in effects[d].items()} for d in doses},
    )


def decide_claims(
    study: Study,
    measured: Mapping[str, Measured],
    control: Mapping[int, float] | None,
    seeds: Sequence[int],
    steps: int,
    plans: Mapping[str, rules.Plan] | None,
    control_what: str,
    measured_controls: Mapping[str, tuple[Mapping[int, float], str, bool]] | None = None,
    control_plans: Mapping[str, PlanRecord] | None = None,
) -> list[ClaimResult]:
    """Every claim decided (``kit.claim_record`` with its plan), Holm over the tested ones.
    ``measured_controls``: {claim key: (per-seed effect, what, calibrated on this claim)} of the
    claims whose control is a ``MeasuredControl`` (instead of ``control``); ``control_plans``:
    {claim key: the seeds its calibrated control needs} (``PowerPlan.controls``)."""

    def interval(effects: Mapping[int, float] | None) -> Interval | None:
        if effects is None or not all(s in effects for s in seeds):
            return None
        return mean_interval([effects[s] for s in seeds])

    control_iv = interval(control)
    out = []
    for claim in study.claims:
        m = measured.get(claim.key)
        if m is None:
            raise ConfigError(f"study {study.name}: measure gave no value for claim {claim.key!r}")
        plan = plans.get(claim.key) if plans is not None else None
        calibrated = study.control is not None and study.control.claim == claim.key
        claim_control, claim_what = control_iv, control_what
        if measured_controls and claim.key in measured_controls:
            effects, claim_what, calibrated = measured_controls[claim.key]
            claim_control = interval(effects)
        equivalence = claim.kind == rules.EQUIVALENCE or claim.report_equivalence
        plan_record = PlanRecord.from_plan(plan, kind=claim.kind) if plan is not None else None
        rec = kit.claim_record(
            claim.statement,
            claim_interval(m, seeds),
            claim_control,
            claim_what,
            threshold=claim.threshold,
            budget_ok=steps >= claim.min_steps,
            scale=claim.scale,
            unit=claim.unit,
            paper_effect=claim.effect,
            paper_source=claim.source,
            control_min=claim.size if calibrated else 0.0,
            delta=claim.margin if equivalence else None,
            precondition=m.precondition,
            regime=m.regime,
            role=claim.role,
            effect_values=[m.effect[s] for s in seeds if s in m.effect],
            plan=plan_record,
            control_plan=(control_plans or {}).get(claim.key) if calibrated else None,
        )
        rec = dataclasses.replace(
            rec,
            key=claim.key,
            words=claim.words,
            kind=claim.kind,
            note=m.note,
            two_level=m.items is not None,
        )
        out.append(kit.with_plan(rec, plan_record))
    return kit.apply_holm(out)


def run_declared(
    study: Study,
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    seeds: int = 3,
    seed_base: int = 0,
    power: bool = False,
    max_seeds: int = 10,
    lr_grid: Sequence[float] | None = kit.LR_GRID,
    lr_cache: Path | None = None,
    quick: bool = False,
    show_progress: bool = False,
    notify: Notify = lambda m: None,
) -> StudyResult:
    """Run a declared study (module docstring) into ``out``; returns its result (``to_json()``:
    the study.json). A study with its own trainer (``Study.trainer``) runs through
    ``run_own``."""
    from curvalign_lab.common import load_study_data

    if study.trainer is not None:
        return run_own(
            study,
            study.trainer,
            out,
            steps=steps,
            data=data,
            overrides=overrides,
            seeds=seeds,
            seed_base=seed_base,
            power=power,
            max_seeds=max_seeds,
            lr_grid=lr_grid,
            quick=quick,
            notify=notify,
        )
    timer = kit.Timer()
    if quick:
        data, steps, seeds, power = study.quick_data, study.quick_steps, QUICK_SEEDS, False
        overrides = [*QUICK_OVERRIDES, *study.quick_overrides, *overrides]
        lr_grid = None
    data = data or study.data
    steps = steps or study.steps
    store, world = load_study_data(data)
    if study.prepare is not None:
        store = study.prepare(store)
    bench = kit.Bench(
        out,
        store,
        data,
        steps,
        overrides,
        val_every=max(1, steps // study.validations),
        # a smoke run stops at its budget: no plateau extension
        max_steps=steps if quick else None,
        lr_grid=lr_grid,
        lr_cache=lr_cache,
        notify=notify,
        show_progress=show_progress,
    )
    handicap = study.control.handicap if study.control is not None else None
    plans: dict[str, rules.Plan] | None = None
    dose_choice: DoseChoice | None = None
    plan_record: PowerPlan | None = None
    measured_choices: dict[str, DoseChoice] = {}
    n = seeds
    if power:
        pilot_seeds = list(range(seed_base + PILOT_OFFSET, seed_base + PILOT_OFFSET + seeds))
        notify(f"{study.name}: pilot, seeds {pilot_seeds[0]}..{pilot_seeds[-1]}")
        pilot, scan = train_arms(
            study, bench, pilot_seeds, handicap.doses if handicap is not None else (), world
        )
        planned = plan_on_pilot(study, pilot, scan, pilot_seeds, max_seeds, timer)
        for _ in range(DOSE_REFINEMENTS):
            choice = planned.dose_choice
            if choice is None or choice.dose is None or handicap is None:
                break
            probe = float(f"{choice.dose:.3g}")
            if any(math.isclose(probe, d) for d in scan):
                break
            # the scan's doses are coarse and a response can bend between two of them (ProCLIP's
            # label noise: 1.1 points at 10%, 5.9 at 30%, 0.9 at the 17% read between them), so
            # the pilot measures the chosen dose too and the dose is read again with it
            notify(f"{study.name}: pilot, the control at its chosen dose {probe:g}")
            scan = {**scan, **train_control(study, bench, pilot, pilot_seeds, [probe])}
            planned = plan_on_pilot(study, pilot, scan, pilot_seeds, max_seeds, timer)
        plans, n, dose_choice = planned.plans, planned.seeds, planned.dose_choice
        measured_choices, plan_record = dict(planned.measured_choices), planned.record
    dose = handicap.dose if handicap is not None else 0.0
    if dose_choice is not None and dose_choice.dose is not None:
        dose = float(f"{dose_choice.dose:.3g}")
    seed_list = list(range(seed_base, seed_base + n))
    trained, control_effects = train_arms(
        study, bench, seed_list, [dose] if handicap else [], world
    )
    measured = study.measure(trained)
    measured_doses: dict[str, float] = {}
    per_claim: dict[str, tuple[Mapping[int, float], str, bool]] = {}
    for mc in study.measured_controls:
        choice = measured_choices.get(mc.claim)
        mc_dose = mc.dose
        if choice is not None and choice.dose is not None:
            mc_dose = float(f"{choice.dose:.3g}")
        measured_doses[mc.claim] = mc_dose
        mc_effects = mc.effect(trained, mc_dose)
        for key in mc.claims:
            per_claim[key] = (mc_effects, mc.text(mc_dose), key == mc.claim)
    r1 = {arm: trained.value(arm) for arm in trained.evals}
    if handicap is not None:
        label = control_label(study, dose)
        r1[label] = dict(trained.control_r1.get(label, {}))
    # the page's extra tables (``Study.tables``, ``Study.report``); present even when empty, so
    # that a page never repeats the body under "markdown" in their place (``page.study_body``)
    extra = (
        study.tables(trained, measured) if study.tables is not None else "",
        study.report(trained) if study.report is not None else "",
    )
    return decided_result(
        study,
        measured,
        control_effects,
        Confirmatory(data, steps, seed_base, tuple(seed_list), quick, dose, dose_choice),
        plans,
        plan_record,
        timer,
        per_claim=per_claim,
        setup=setup_line(
            study, data, steps, [f"{a.recipe} {' '.join(a.options)}" for a in study.arms]
        ),
        lr_choice=dict(bench.lr_choice),
        lr_grid=tuple(bench.lr_grid or ()),
        arms={arm: {str(s): v for s, v in vals.items()} for arm, vals in r1.items()},
        convergence={arm: kit.convergence_record(runs) for arm, runs in trained.runs.items()},
        learning_rates={k: RecipeRate(p, v) for k, (p, v) in bench.learning_rates.items()},
        lr_scale=bench.lr_scale,
        max_steps=bench.max_steps,
        measured_controls=tuple(
            MeasuredControlRecord(
                what=mc.what,
                claims=tuple(mc.claims),
                dose=measured_doses[mc.claim],
                doses_scanned=tuple(mc.doses),
                choice=measured_choices.get(mc.claim),
            )
            for mc in study.measured_controls
        ),
        starts={a: {str(s): r for s, r in v.items()} for a, v in bench.starts.items()},
        figures=tuple(str(f) for f in study.figures(trained, out)) if study.figures else (),
        arms_metric=f"test {study.metric}" if study.metric is not None else None,
        tables="\n\n".join(t for t in extra if t),
    )


def setup_line(
    study: Study,
    data: str,
    steps: int,
    arm_settings: Sequence[str],
    overrides: Sequence[str] = (),
) -> str:
    """The study's setup in one line: its data and budget, each arm with ``arm_settings`` (one
    per arm: what trains it), the overrides every run got and the baselines."""
    arms = "; ".join(
        f"{a.label} ({text})".strip() for a, text in zip(study.arms, arm_settings, strict=True)
    )
    return (
        f"{data}, {steps} steps per run; arms: {arms}"
        + (f"; overrides: {' '.join(overrides)}" if overrides else "")
        + (f"; baselines: {', '.join(study.baselines)}" if study.baselines else "")
        + "."
    )


@dataclass(frozen=True)
class Confirmatory:
    """What the confirmatory run was: its data, step budget, seed base and seeds, whether it is
    a smoke (``quick``), and its control's dose (with the pilot's choice, if a pilot ran)."""

    data: str
    steps: int
    seed_base: int
    seeds: tuple[int, ...]
    quick: bool
    dose: float
    dose_choice: DoseChoice | None


def decided_result(
    study: Study,
    measured: Mapping[str, Measured],
    control_effects: Mapping[float, Mapping[int, float]],
    run: Confirmatory,
    plans: Mapping[str, rules.Plan] | None,
    plan_record: PowerPlan | None,
    timer: kit.Timer,
    *,
    per_claim: Mapping[str, tuple[Mapping[int, float], str, bool]] | None = None,
    starts: Mapping[str, Mapping[str, Any]],
    **fields: Any,
) -> StudyResult:
    """The claims decided (``decide_claims``) and the study's record, with its page body: what
    both runners share; ``fields`` are the runner's own ``StudyResult`` fields (its arms'
    values, setup line, learning rates, tables)."""
    from curvalign_lab import page

    handicap = study.control.handicap if study.control is not None else None
    control_what = (
        f"{study.control.arm} clean - {handicap.text(run.dose)}"
        if study.control is not None and handicap is not None
        else "no control"
    )
    claims = decide_claims(
        study,
        measured,
        control_effects.get(run.dose) if handicap is not None else None,
        run.seeds,
        run.steps,
        plans,
        control_what,
        per_claim,
        plan_record.controls if plan_record is not None else None,
    )
    result = StudyResult(
        name=study.name,
        declared=True,
        paper=study.paper,
        preconditions=tuple(study.preconditions),
        notes=study.notes,
        rule=kit.RULE,
        claims=tuple(claims),
        verdict=kit.verdict_line(claims),
        holds=kit.all_hold(claims),
        seeds=run.seeds,
        seed_base=run.seed_base,
        steps=run.steps,
        data=run.data,
        quick=run.quick,
        control=ControlRecord(
            what=handicap.what if handicap else None,
            dose=run.dose if handicap else None,
            doses_scanned=(
                tuple(float(d) for d in run.dose_choice.scan)
                if run.dose_choice is not None
                else tuple(handicap.doses)
            )
            if handicap
            else (),
            choice=run.dose_choice,
        ),
        starts=starts,
        starts_fired=tuple(kit.starts_fired(starts)),
        wall_s=timer.seconds(),
        power_plan=plan_record,
        **fields,
    )
    return dataclasses.replace(result, markdown=page.study_body(result))


@dataclass(frozen=True)
class PilotPlan:
    """What a pilot decides before the confirmatory run: each tested claim's plan, each
    calibrated control's dose and plan, the seeds of the confirmatory run and the record."""

    plans: dict[str, rules.Plan]
    seeds: int
    dose_choice: DoseChoice | None
    measured_choices: Mapping[str, DoseChoice]
    record: PowerPlan


def plan_on_pilot(
    study: Study,
    pilot: Trained,
    scan: Mapping[float, Mapping[int, float]],
    pilot_seeds: Sequence[int],
    max_seeds: int,
    timer: kit.Timer,
) -> PilotPlan:
    """The confirmatory run planned on a pilot (module docstring): each tested claim's seeds
    (``plan_study``); the control's dose from its scan (``choose_dose``) and the seeds it needs
    to separate at its own pilot noise (``rules.plan_control``), the same for every measured
    control; the run takes the most seeds any plan asks, claims' and controls' alike (the cap
    for an underpowered one: ``rules.study_seeds``), at least ``rules.MIN_SEEDS``, never above
    ``max_seeds``."""
    plans = plan_study(study, study.measure(pilot), pilot_seeds, max_seeds)
    controls: dict[str, rules.Plan] = {}
    dose_choice = None
    if study.control is not None and scan:
        dose_choice = choose_dose(study, scan)
        controls[study.control.claim] = rules.plan_control(
            scan, dose_choice.dose, dose_choice.target, max_seeds
        )
    measured_choices = {}
    for mc in study.measured_controls:
        mc_scan = {d: mc.effect(pilot, d) for d in mc.doses}
        choice = _dose_choice(study.claim(mc.claim).size, mc_scan)
        measured_choices[mc.claim] = choice
        controls[mc.claim] = rules.plan_control(mc_scan, choice.dose, choice.target, max_seeds)
    n = min(max_seeds, rules.study_seeds([*plans.values(), *controls.values()]))
    record = PowerPlan(
        per_claim={k: PlanRecord.from_plan(p, kind=study.claim(k).kind) for k, p in plans.items()},
        seeds=n,
        max_seeds=max_seeds,
        pilot_seeds=len(pilot_seeds),
        pilot_seed_base=pilot_seeds[0],
        out_of_budget=tuple(k for k, p in plans.items() if p.underpowered),
        pilot_wall_s=timer.seconds(),
        controls={k: PlanRecord.from_plan(p, kind="control") for k, p in controls.items()},
    )
    return PilotPlan(plans, n, dose_choice, measured_choices, record)


def train_own(
    study: Study,
    trainer: ArmTrainer[W],
    world: W,
    seeds: Sequence[int],
    doses: Sequence[float],
    *,
    steps: int,
    overrides: Sequence[str],
    lr_choice: dict[str, LrChoice],
    lr_grid: Sequence[float] | None,
    notify: Notify,
) -> tuple[Trained, dict[float, dict[int, float]]]:
    """``train_arms`` for a study with its own trainer: every arm with every seed, and the
    control at each of ``doses`` (trained on ``trainer.handicap(world, dose, seed)``, measured
    on ``world``); the control's effect is clean - handicapped on ``trainer.score``. With
    ``lr_grid``, each arm's rate is chosen first (``kit.climb_grid`` on ``score`` with
    ``kit.TUNE_SEED``; cached in ``lr_choice``) and the control trains at its arm's rate."""
    # the measure reads ``own``: a study with its own trainer has no bench
    trained = Trained(cast("kit.Bench", None), list(seeds))

    def run(label: str, arm: Arm, options: Sequence[str], seed: int, on: W) -> OwnRun:
        notify(f"{label} seed {seed}: {steps} steps")
        return trainer.train(on, world, arm, options, seed, steps, notify)

    def options_of(arm: Arm) -> list[str]:
        options = [*overrides]
        if lr_grid:
            if arm.label not in lr_choice:

                def fit(lr: float) -> float:
                    out = run(
                        f"{arm.label} lr {lr:g}",
                        arm,
                        [*options, f"lr={lr:g}"],
                        kit.TUNE_SEED,
                        world,
                    )
                    value = out.values.get(trainer.score, math.nan)
                    return value if math.isfinite(value) else -math.inf

                chosen, grid = kit.climb_grid(lr_grid, kit.LR_START, fit)
                # the own trainer has no precondition per rate: no rate is excluded
                lr_choice[arm.label] = LrChoice("own trainer", chosen, tuple(grid.items()), {})
            options.append(f"lr={lr_choice[arm.label].chosen:g}")
        return options

    for arm in study.arms:
        options = options_of(arm)
        for seed in seeds:
            trained.own.setdefault(arm.label, {})[seed] = run(arm.label, arm, options, seed, world)
    effects: dict[float, dict[int, float]] = {}
    if study.control is None:
        return trained, effects
    clean_arm = next(a for a in study.arms if a.label == study.control.arm)
    options = options_of(clean_arm)
    for dose in doses:
        label = control_label(study, dose)
        for seed in seeds:
            handicapped = trainer.handicap(world, dose, seed)
            out = run(label, clean_arm, options, seed, handicapped)
            trained.own.setdefault(label, {})[seed] = out
            clean = trained.own[clean_arm.label][seed].values[trainer.score]
            effects.setdefault(dose, {})[seed] = clean - out.values[trainer.score]
    return trained, effects


def run_own(
    study: Study,
    trainer: ArmTrainer[W],
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    seeds: int = 3,
    seed_base: int = 0,
    power: bool = False,
    max_seeds: int = 10,
    lr_grid: Sequence[float] | None = kit.LR_GRID,
    quick: bool = False,
    notify: Notify = lambda m: None,
) -> StudyResult:
    """``run_declared``'s steps (module docstring) for a study whose arms its own ``trainer``
    trains (``ArmTrainer``): quick smoke, pilot plan and dose scan, confirmatory run, claims
    decided and the page written; every arm's start (``OwnRun.start``) is recorded in
    ``starts`` and the page lists any warning that fired. ``out`` is created; the trainer
    writes nothing there (its runs are small: their values are in the result)."""
    timer = kit.Timer()
    out.mkdir(parents=True, exist_ok=True)
    if quick:
        data, steps, seeds, power = study.quick_data, study.quick_steps, QUICK_SEEDS, False
        # the recipes' smoke overrides (QUICK_OVERRIDES) are not this trainer's settings
        overrides = [*study.quick_overrides, *overrides]
        lr_grid = None
    data = data or study.data
    steps = steps or study.steps
    world = trainer.load(data)
    handicap = study.control.handicap if study.control is not None else None
    lr_choice: dict[str, LrChoice] = {}
    common: dict[str, Any] = {
        "steps": steps,
        "overrides": list(overrides),
        "lr_choice": lr_choice,
        "lr_grid": tuple(lr_grid) if lr_grid else None,
        "notify": notify,
    }
    plans: dict[str, rules.Plan] | None = None
    dose_choice: DoseChoice | None = None
    plan_record: PowerPlan | None = None
    n = seeds
    if power:
        pilot_seeds = list(range(seed_base + PILOT_OFFSET, seed_base + PILOT_OFFSET + seeds))
        notify(f"{study.name}: pilot, seeds {pilot_seeds[0]}..{pilot_seeds[-1]}")
        pilot, scan = train_own(
            study, trainer, world, pilot_seeds, handicap.doses if handicap else (), **common
        )
        planned = plan_on_pilot(study, pilot, scan, pilot_seeds, max_seeds, timer)
        plans, n, dose_choice, plan_record = (
            planned.plans,
            planned.seeds,
            planned.dose_choice,
            planned.record,
        )
    dose = handicap.dose if handicap is not None else 0.0
    if dose_choice is not None and dose_choice.dose is not None:
        dose = float(f"{dose_choice.dose:.3g}")
    seed_list = list(range(seed_base, seed_base + n))
    trained, control_effects = train_own(
        study, trainer, world, seed_list, [dose] if handicap else [], **common
    )
    measured = study.measure(trained)
    starts = {
        label: {str(s): dict(r.start) for s, r in runs.items()}
        for label, runs in trained.own.items()
    }
    return decided_result(
        study,
        measured,
        control_effects,
        Confirmatory(data, steps, seed_base, tuple(seed_list), quick, dose, dose_choice),
        plans,
        plan_record,
        timer,
        own_trainer=True,
        setup=setup_line(study, data, steps, [" ".join(a.options) for a in study.arms], overrides),
        lr_choice=dict(lr_choice),
        lr_grid=tuple(lr_grid or ()),
        arms={
            label: {str(s): r.values.get(trainer.score) for s, r in runs.items()}
            for label, runs in trained.own.items()
        },
        arms_metric=trainer.metric,
        values={
            label: {str(s): dict(r.values) for s, r in runs.items()}
            for label, runs in trained.own.items()
        },
        loss_history={
            label: {str(s): tuple(tuple(h) for h in r.history) for s, r in runs.items()}
            for label, runs in trained.own.items()
        },
        starts=starts,
        figures=(),
        tables=trainer.table(trained) if trainer.table is not None else None,
    )


__all__ = [
    "PILOT_OFFSET",
    "QUICK_DATA",
    "QUICK_WORLD",
    "Arm",
    "ArmTrainer",
    "Claim",
    "Confirmatory",
    "Control",
    "During",
    "Handicap",
    "Measured",
    "MeasuredControl",
    "Phases",
    "OwnRun",
    "PilotPlan",
    "Study",
    "Trained",
    "choose_dose",
    "claim_interval",
    "configured",
    "decide_claims",
    "decided_result",
    "label_noise",
    "metric_value",
    "option_names",
    "plan_on_pilot",
    "plan_study",
    "run_declared",
    "run_own",
    "train_arms",
    "train_own",
]
