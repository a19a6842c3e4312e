"""wordnet-dimensions as Nickel & Kiela's task: the closure of a tree, the graph embedding
trainer (seeded, curved start, learns), reconstruction, the rewiring control (a dose-response
that can fail) and the declared study through its own trainer (``--quick`` and a tiny pilot)."""

from __future__ import annotations

import json

import pytest
import torch

from curvalign.errors import ConfigError
from curvalign_lab import declare, graphs, kit
from curvalign_lab.studies import wordnet_dimensions as wd

SMALL = "tree:branching=2,depth=3"  # 15 nodes, 34 closure pairs
TINY_TREE = "tree:branching=2,depth=2"  # 7 nodes, 10 closure pairs
FAST = ["batch_size=32", "negatives=8"]


# --- reconstruction (the measure) ----------------------------------------------------------------


def _tree_store(features, parents):
    """One 'image' per taxonomy node (label = node), ``parents`` the tree."""
    from curvalign.data.features import FeatureStore, TextPart

    n = features.shape[0]
    return FeatureStore(
        image_features=features,
        text=TextPart(features.clone()),
        text_to_image=torch.arange(n),
        class_names=[f"n{i}" for i in range(n)],
        prompt=TextPart(features.clone()),
        prompt_to_class=torch.arange(n),
        image_labels=torch.arange(n),
        taxonomy_names=[f"n{i}" for i in range(n)],
        taxonomy_parents=torch.tensor(parents),
        class_to_node=torch.arange(n),
    )


def test_graph_reconstruction_ranks_the_closure_by_distance():
    from curvalign.eval.frozen import FrozenFeatures
    from curvalign_lab.common import reconstruction

    # root 0 with leaves 1 and 2: 0 is related to both, 1 and 2 are unrelated to each other
    parents = [-1, 0, 0]
    model = FrozenFeatures(2, 2)
    good = torch.tensor([[1.0, 1.0], [1.0, 0.2], [0.2, 1.0]])
    rec = reconstruction(model, _tree_store(good, parents))
    # cos(1, 0) = 0.83 > cos(1, 2) = 0.38: every related node ranks first
    assert rec == {"mean_rank": pytest.approx(1.0), "map": pytest.approx(1.0), "nodes": 3}
    # the root moved away: cos(1, 0) = -0.20 and cos(2, 0) = -0.98 are below cos(1, 2) = 0.38,
    # so for u = 1 and u = 2 the root ranks 2nd (AP 1/2); u = 0 has no unrelated node (AP 1)
    bad = torch.tensor([[0.0, -1.0], [1.0, 0.2], [0.2, 1.0]])
    worse = reconstruction(model, _tree_store(bad, parents))
    assert worse["map"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert worse["mean_rank"] == pytest.approx((1 + 1 + 2 + 2) / 4)


def test_embedding_reconstruction_uses_distances_of_its_geometry():
    # a path 0 - 1 - 2 (closure: (1, 0), (2, 1), (2, 0)) plus a lone root 3 with a child 4
    graph = graphs.Graph(
        [f"n{i}" for i in range(5)], torch.tensor([[1, 0], [2, 1], [2, 0], [4, 3]])
    )
    config = graphs.EmbedConfig.parse(["geometry=euclidean", "dim=1"])
    # on a line: 4 next to 3, both far from the path: every related node is nearer than the rest
    points = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
    assert graphs.reconstruction(graph, points, config)["map"] == pytest.approx(1.0)
    # 4 moved next to 0: for u = 0 the unrelated 4 now outranks 2 (AP (1 + 2/3) / 2)
    points[4] = 0.5
    rec = graphs.reconstruction(graph, points, config)
    assert rec["map"] < 1.0 and rec["mean_rank"] > 1.0


# --- the graph and the handicap ------------------------------------------------------------------


def test_tree_closure_and_rewiring():
    g = graphs.load_graph(SMALL)
    assert g.n == 15 and g.pairs.shape == (2 * 1 + 4 * 2 + 8 * 3, 2)
    rel = g.related()
    assert torch.equal(rel, rel.T) and not rel.diagonal().any()
    assert rel[7, 0] and rel[7, 1] and rel[7, 3] and not rel[7, 8]  # leaf 7: 3 -> 1 -> 0
    same = graphs.rewired(g, 0.0, seed=1)
    assert torch.equal(same.pairs, g.pairs)
    half = graphs.rewired(g, 0.5, seed=1)
    moved = (half.pairs[:, 1] != g.pairs[:, 1]).sum()
    assert 0 < moved <= 17  # 17 pairs drawn; a draw may land on the old ancestor
    assert torch.equal(half.pairs[:, 0], g.pairs[:, 0])  # only the ancestor moves
    assert (half.pairs[:, 0] != half.pairs[:, 1]).all()  # never a self-loop
    assert torch.equal(graphs.rewired(g, 0.5, seed=1).pairs, half.pairs)  # seeded


def test_bad_graph_and_options_are_one_clear_error():
    with pytest.raises(ConfigError, match="tree:branching"):
        graphs.load_graph("cycle:5")
    with pytest.raises(ConfigError, match="tree:branching"):
        graphs.load_graph("tree:width=3")
    with pytest.raises(ConfigError, match="dim='x': expected an integer"):
        graphs.EmbedConfig.parse(["dim=x"])
    with pytest.raises(ConfigError, match="KEY one of geometry"):
        graphs.EmbedConfig.parse(["pair_batch_size=16"])
    with pytest.raises(ConfigError, match="geometry must be one of"):
        graphs.EmbedConfig.parse(["geometry=sphere"])
    with pytest.raises(ConfigError, match="share must be in"):
        graphs.rewired(graphs.load_graph(TINY_TREE), 1.5, 0)


# --- the trainer ---------------------------------------------------------------------------------


def test_hyperbolic_arm_starts_curved_is_seeded_and_learns(one_thread):
    g = graphs.load_graph(SMALL)
    config = graphs.EmbedConfig.parse(["geometry=lorentz", "dim=2", *FAST])
    a = graphs.embed_graph(g, config, steps=60, seed=3)
    # the start is not flat: c r^2 well above the step-0 check's 0.01 (about init_radius^2)
    assert a.start["curvature_radius2"] > 0.2 and not a.start["warnings"]
    # seeded: the same seed repeats the same computation, bit for bit
    b = graphs.embed_graph(g, config, steps=60, seed=3)
    assert torch.equal(a.points, b.points)
    assert not torch.equal(graphs.embed_graph(g, config, steps=60, seed=4).points, a.points)
    # it learns: the loss falls and the reconstruction beats the start's
    assert a.history[-1][1] < a.history[0][1]
    start = graphs.embed_graph(g, config, steps=1, seed=3)
    rec, rec0 = (graphs.reconstruction(g, r.points, config)["map"] for r in (a, start))
    assert rec > rec0 + 0.2, (rec, rec0)
    # the Euclidean arm has no curvature to report
    flat = graphs.embed_graph(
        g, graphs.EmbedConfig.parse(["geometry=euclidean", *FAST]), steps=2, seed=3
    )
    assert flat.start["curvature_radius2"] is None


def test_a_flat_start_is_reported():
    config = graphs.EmbedConfig.parse(["geometry=lorentz", "dim=2", "init_radius=0.01"])
    run = graphs.embed_graph(graphs.load_graph(TINY_TREE), config, steps=1, seed=0)
    assert [w["code"] for w in run.start["warnings"]] == ["flat_geometry"]
    assert kit.starts_fired({"h": {0: run.start}}) == ["h: flat_geometry on seeds 0"]


def test_long_runs_say_how_far_they_are():
    lines: list[str] = []
    config = graphs.EmbedConfig.parse(
        ["geometry=euclidean", "dim=2", "batch_size=4", "negatives=2"]
    )
    graphs.embed_graph(
        graphs.load_graph(TINY_TREE),
        config,
        steps=graphs.PROGRESS_FROM,
        seed=0,
        notify=lines.append,
    )
    assert len(lines) == 10 and lines[-1].startswith(
        f"euclidean seed 0: step {graphs.PROGRESS_FROM}/"
    )


# --- the control: a dose-response that separates, or fails to calibrate --------------------------


def _one_arm_study(effect: float) -> declare.Study:
    arm = wd._arm(graphs.LORENTZ, 2)
    return declare.Study(
        name="toy-graph",
        paper="toy",
        claims=(declare.Claim("c", "toy", words="toy", source="toy", effect=effect),),
        arms=(arm,),
        measure=lambda t: {},
        control=declare.Control(
            arm.label, declare.Handicap("{dose} rewired", doses=(0.5, 1.0), dose=0.5), "c"
        ),
        trainer=wd.TRAINER,
    )


def test_rewiring_control_separates_by_dose_and_fails_when_it_cannot_reach_the_size(one_thread):
    world = graphs.load_graph(SMALL)

    def scan(study: declare.Study) -> dict:
        _, effects = declare.train_own(
            study,
            wd.TRAINER,
            world,
            [0],
            (0.5, 1.0),
            steps=60,
            overrides=FAST,
            lr_choice={},
            lr_grid=None,
            notify=lambda m: None,
        )
        return declare.choose_dose(study, effects)

    reachable = scan(_one_arm_study(effect=0.15))
    # more rewiring costs more MAP on the clean closure, and the scan reaches the claim's size
    assert reachable.scan["1"] > reachable.scan["0.5"] > 0
    assert reachable.calibrated and 0.0 < reachable.dose <= 1.0
    # a claim of 0.8 MAP is more than rewiring every pair costs here: the control cannot
    # calibrate (and a claim needing it cannot hold)
    assert not scan(_one_arm_study(effect=0.8)).calibrated


# --- the declared study, through its own trainer -------------------------------------------------


def test_quick_study_records_curved_starts_and_is_too_short(tmp_path, one_thread):
    from curvalign_lab.runner import run_study

    result = run_study("wordnet-dimensions", tmp_path / "q", quick=True)
    assert result.data == wd.QUICK_TREE and result.seeds == (0, 1) and result.quick
    assert {c.key for c in result.claims} == {"low-d", "few-dims"}
    for claim in result.claims:
        assert claim.outcome == kit.TOO_SHORT  # 30 steps < the claims' 200
    labels = {a.label for a in wd.STUDY.arms}
    assert labels == {f"{g} d={d}" for g in ("hyperbolic", "euclidean") for d in wd.DIMS}
    # every run's start is recorded; the hyperbolic ones are curved (c r^2 > 0.01), none fired
    starts = result.starts
    assert labels <= set(starts) and result.starts_fired == ()
    for d in wd.DIMS:
        for rec in starts[f"hyperbolic d={d}"].values():
            assert rec["curvature_radius2"] > 0.1
    control = next(k for k in starts if k.startswith("control: hyperbolic d=5"))
    assert set(starts[control]) == {"0", "1"}
    saved = json.loads((tmp_path / "q" / "study.json").read_text())
    assert saved["command"] == f"curvalign study wordnet-dimensions --out {tmp_path / 'q'} --quick"
    page = (tmp_path / "q" / "study.md").read_text()
    assert "reconstruction MAP x100" in page and "Every arm's step-0 check passed" in page
    assert "from d=50 on" in page  # the reproduction's finding, not "at every d"


def test_pilot_plans_and_scans_the_control_at_tiny_size(tmp_path, one_thread):
    from curvalign_lab.runner import run_study

    result = run_study(
        "wordnet-dimensions",
        tmp_path / "p",
        data=TINY_TREE,
        steps=4,
        seeds=2,
        seed_base=5,
        power=True,
        max_seeds=3,
        overrides=FAST,
        lr_grid=(0.03, 0.1),
    )
    plan = result.power_plan
    assert plan.pilot_seed_base == 5 + declare.PILOT_OFFSET and 2 <= plan.seeds <= 3
    assert set(plan.per_claim) == {"low-d", "few-dims"}
    choice = result.control.choice
    assert set(choice.scan) == {"0.25", "0.5", "0.75", "1"} and choice.target == 0.8
    # 4 steps cannot cost 0.8 MAP: the control does not calibrate, no claim holds
    assert not choice.calibrated
    assert all(c.holm_verdict != kit.HOLDS for c in result.claims)
    # each arm's rate was chosen on the graph's reconstruction with the tuning seed
    assert set(result.lr_choice) == {a.label for a in wd.STUDY.arms}
    assert all(c.chosen in (0.03, 0.1) for c in result.lr_choice.values())
    assert result.seeds == tuple(range(5, 5 + plan.seeds))
