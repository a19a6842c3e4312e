"""AGR, Adaptive Geometry Routing (seed 000; Algorithm 1 and Secs. 3-4).

Trunk      the recipe's inputs are frozen-encoder features, which is what the paper's trunk is
           (Sec. 4.1: "frozen ViT encoders extract trunk representations"; its 2.1M trainable
           parameters are heads, router, gates and contexts only). ``trunk="identity"`` (default)
           uses them as they are. ``trunk="residual"`` adds one trainable layer per modality,
           ``h = f + W f`` with ``W`` zero-initialised, shared by both heads: the trainable
           backbone of Table 1, which the hyperbolic head trains and nothing else reaches.
Heads      Euclidean: ``normalize((W_0 + scaling B A) sg(h))`` with ``W_0`` frozen and a rank-64
           LoRA (Sec. 4.1.1, Eq. 12); its input is detached from the trunk (Table 1).
           Lorentz: ``expmap0(clip_norm(W_H h, kappa), c)`` with
           ``clip_norm(v, kappa) = v min(1, kappa / (|v| sqrt(c)))``, kappa 1 (Eq. 5), and the
           curvature ``c = exp(gamma)`` clamped to ``[1e-4, 2]``, init 0.1. ``W_H`` is
           initialised small (outputs of norm ~1), so the clip is a safety bound and not a
           projection of every point onto one sphere (the paper does not give the init).
Scores     ``S_E = cos / tau_E`` (tau_E learnable, init 0.07, floor 0.01), ``S_H = -d_L``
           (``-d_L / tau_H`` with the ``learn_tau_h`` option);
           router, query gate, calibration and the routed score ``S_AGR`` as in
           ``curvalign.nn.router`` (Algorithm 1, lines 22-34).
Loss       ``CE`` both directions on ``S_AGR`` (averaged, like every recipe here)
           ``- lambda_ent(t) E[H(w)]`` (lambda 0.01 annealed linearly to 0)
           ``+ 0.1 (mean w - 0.5)^2`` (mean over the global batch)
           ``+ expert_weight x (CE on S_E + CE on S_H)`` (see "Experts' own losses" below).
Curriculum ``alpha(t)``, ``beta(t)``, phases and ``single_schedule`` from
           ``curvalign.schedules.AGRCurriculum``, boundaries as fractions of the run (default)
           or in steps.
Ranking    ``scores(texts, images, query)`` is ``S_AGR`` with the query side's gate and
           calibration, at the curriculum values of the last training step (a fresh model has
           ``alpha = 0``: pure hyperbolic retrieval). ``pair_scores`` is the router's pair mode,
           for matched rows ``[n]`` or candidate lists (tensors ``[n, 1, ...]`` against
           ``[n, K, ...]``), used to rerank index candidates.

Experts' own losses
    Eq. 25 alone gives the Euclidean head no gradient before Soft Launch (``beta = 0`` removes
    ``S_E`` from the score), yet the paper calls both heads "active" during Isolation, reports
    the Euclidean contrastive loss falling 5x faster than the hyperbolic one in the first 5K
    steps, and evaluates each expert alone (Table 3, "E only", "H only"). The project trains
    each expert with its own symmetric InfoNCE as well (``expert_weight``, default 1); set it to
    0 for the literal Eq. 25. The experts' losses are logged either way.

Gradient flow (Table 1, tested in tests/test_agr.py)
    hyperbolic head -> trunk: yes.  Euclidean LoRA -> trunk: no (its input is ``sg(h)``).
    router, contexts, gates, calibration -> trunk or heads: no (they read ``sg(h)`` and the two
    scores detached). The routed score still trains both heads through ``S_H`` and ``Delta``.
    Declared as ``trunk_gradient_keys = ("lorentz",)``.

The paper's regime with towers (tests/test_towers_regimes.py)
    One shared backbone (a tower pair, ``curvalign train --towers``, LoRA or full) feeds both
    heads; its features are ``h``. The backbone then trains through the hyperbolic head alone,
    the Euclidean expert adapts on top of it by its LoRA (Sec. 4.1.1), and the whole loss
    (routed score, experts' own losses, entropy, load balance) reaches the towers only through
    the ``lorentz`` embedding. The paper's experiments freeze the ViT (Sec. 4.1 and 6: 2.1M
    trainable parameters, heads and router only): that is ``trunk="identity"`` on a feature
    store, or locked towers; Table 1's trainable backbone is this regime.

Embedding  {"euclidean": [N, d] unit vectors, "lorentz": [N, d] Lorentz space components,
            "context": [N, 16] phi(sg h), "gate_logit": [N], "calibration_logit": [N, 3]}.
            The gate and calibration are kept as logits (linear in ``h``), so a class embedding
            averages them exactly like its features.
Logged     routing_weight (mean w), gate (and gate/text, gate/image), alpha, beta, phase
           (1 Isolation .. 4 Adaptive, 0 single-schedule warm-up), curvature, tau_e,
           router_temperature, entropy_weight, routing_entropy, loss_euclidean, loss_hyperbolic,
           and from the end of the warm-up on routing_weight_at_warmup_end and
           dominance_at_warmup_end (+1 Euclidean dominance w > 0.9, -1 hyperbolic w < 0.1,
           0 balanced; Definition 5.2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from curvalign.data.alignment import LinearAlignment
from curvalign.data.statistics import FeatureNorms
from curvalign.geometry import lorentz, sphere
from curvalign.losses.contrastive import symmetric_info_nce
from curvalign.losses.routing import load_balance, routing_entropy
from curvalign.nn.heads import LorentzHead, clip_tangent_norm, resolve_tangent_scale
from curvalign.nn.lora import LoRALinear
from curvalign.nn.router import (
    PairwiseRouter,
    QueryConditioner,
    routed_scores,
    routed_scores_both,
)
from curvalign.nn.scalars import LearnableScalar
from curvalign.recipes import register
from curvalign.recipes.base import (
    Batch,
    Embedding,
    Gather,
    HyperbolicRecipe,
    IndexProxy,
    LossOutput,
    Progress,
    Query,
    round_resolved,
    start_agreement,
)
from curvalign.schedules import (
    AGRCurriculum,
    agr_alpha,
    agr_beta,
    agr_entropy_weight,
    agr_phase_index,
    agr_warmup_end_step,
)
from curvalign.scores import (
    cosine_pair_scores,
    cosine_scores,
    lorentz_distance_pair_scores,
    lorentz_distance_scores,
)

KEYS = ("euclidean", "lorentz", "context", "gate_logit", "calibration_logit")


@dataclass
class AGRConfig:
    """AGR's settings; defaults from the paper (Sec. 6.1, Table 7).

    embed_dim               d of both heads (512)
    trunk                   "identity" (frozen features are the trunk) or "residual" (one
                            trainable zero-initialised layer per modality, trained by the
                            hyperbolic head only)
    lora_rank, lora_alpha   Euclidean LoRA rank (64) and alpha (None: alpha = rank, scaling 1)
    curvature_*             c init 0.1, clamped to [1e-4, 2], learnable (Sec. 3.1, Eq. 23)
    clip_kappa              kappa of clip_norm (1.0)
    tangent_scale           W_H's initialisation is scaled by this factor (both sides) when set;
                            None (default): each side's factor (``image_tangent_scale``,
                            ``text_tangent_scale``) is resolved from the train features' mean
                            norm so the step-0 tangent vectors have mean norm 1, inside the clip
                            radius (``nn.heads.resolve_tangent_scale``; for the papers'
                            features, norm sqrt(D), it gives 1/sqrt(embed_dim); not in the paper)
    tau_e_*                 Euclidean temperature, init 0.07, floor 0.01, learnable
    context_dim             per-item router context size (16; 2 + 2 x 16 = 34 inputs)
    router_hidden           router MLP hidden widths (64, 32)
    router_dropout          dropout in the router MLP (0.1; the paper gives none)
    gate_temperature        T_gate init (0.5) and floor ``gate_temperature_min`` (0.5)
    learn_gate_temperature  learn T_gate above its floor (Table 5 reports a learned 2.0)
    score_jitter            std of the Gaussian jitter on the router's scalar inputs (0.1)
    max_delta               Delta_max of the bounded correction (5.0)
    load_balance_weight     lambda_lb (0.1)
    expert_weight           weight of the experts' own InfoNCE (1.0; 0 = Eq. 25 literally)
    alpha_start .. beta_end the curriculum boundaries (Eqs. 19-20), in ``schedule_unit``
    entropy_weight          lambda_ent at step 0 (0.01), annealed to 0 at ``entropy_anneal_end``
    schedule_unit           "fraction" of the run (default; the paper's steps / 120K) or "steps"
    single_schedule         the ablation ramping alpha and beta together from step 0
    delta_form              "algorithm1" (default): ``Delta = Dmax tanh((sE beta S_E - S_H)/Dmax)``,
                            beta inside the correction as Algorithm 1 line 32 writes it;
                            "equation": Eqs. 16/21, ``Delta`` from the raw ``S_E`` (beta only
                            throttles what the router sees)
    head_init               "align" (default): both experts start at the data's linear alignment,
                            the router neutral (``AGR.warm_start``); "paper": random heads,
                            ``nn.Linear``'s init for the frozen LoRA base (the paper gives none)
    tau_h_init, learn_tau_h hyperbolic temperature: ``S_H = -d_L / tau_H`` (Algorithm 1 lists
                            tau_H among the learnable scalars; Eq. 9 has none). Default 1.0,
                            fixed: ``S_H = -d_L`` as in Eq. 9; floor ``tau_h_min`` (0.01)
    """

    embed_dim: int = 512
    trunk: Literal["identity", "residual"] = "identity"
    lora_rank: int = 64
    lora_alpha: float | None = None
    curvature_init: float = 0.1
    curvature_min: float = 1e-4
    curvature_max: float = 2.0
    learn_curvature: bool = True
    clip_kappa: float = 1.0
    tangent_scale: float | None = None
    tau_e_init: float = 0.07
    tau_e_min: float = 0.01
    learn_tau_e: bool = True
    context_dim: int = 16
    router_hidden: tuple[int, int] = (64, 32)
    router_dropout: float = 0.1
    gate_temperature: float = 0.5
    gate_temperature_min: float = 0.5
    learn_gate_temperature: bool = True
    score_jitter: float = 0.1
    max_delta: float = 5.0
    load_balance_weight: float = 0.1
    expert_weight: float = 1.0
    alpha_start: float = AGRCurriculum.alpha_start
    alpha_end: float = AGRCurriculum.alpha_end
    beta_start: float = AGRCurriculum.beta_start
    beta_end: float = AGRCurriculum.beta_end
    entropy_weight: float = AGRCurriculum.entropy_weight
    entropy_anneal_end: float = AGRCurriculum.entropy_anneal_end
    schedule_unit: Literal["fraction", "steps"] = "fraction"
    single_schedule: bool = False
    delta_form: Literal["algorithm1", "equation"] = "algorithm1"
    tau_h_init: float = 1.0
    tau_h_min: float = 0.01
    learn_tau_h: bool = False
    image_tangent_scale: float | None = None
    text_tangent_scale: float | None = None
    head_init: str = "align"

    def __post_init__(self) -> None:
        checks = [
            (
                self.head_init in ("align", "paper"),
                f"head_init must be 'align' or 'paper', got {self.head_init!r}",
            ),
            (
                self.delta_form in ("algorithm1", "equation"),
                f"delta_form must be 'algorithm1' or 'equation', got {self.delta_form!r}",
            ),
            (
                0 < self.tau_h_min <= self.tau_h_init,
                f"need 0 < tau_h_min <= tau_h_init, got {self.tau_h_min}, {self.tau_h_init}",
            ),
            (self.embed_dim > 0, f"embed_dim must be positive, got {self.embed_dim}"),
            (
                self.trunk in ("identity", "residual"),
                f"trunk must be 'identity' or 'residual', got {self.trunk!r}",
            ),
            (self.lora_rank > 0, f"lora_rank must be positive, got {self.lora_rank}"),
            (
                0 < self.curvature_min <= self.curvature_init <= self.curvature_max,
                "need 0 < curvature_min <= curvature_init <= curvature_max, got "
                f"{self.curvature_min}, {self.curvature_init}, {self.curvature_max}",
            ),
            (self.clip_kappa > 0, f"clip_kappa must be positive, got {self.clip_kappa}"),
            (
                0 < self.tau_e_min <= self.tau_e_init,
                f"need 0 < tau_e_min <= tau_e_init, got {self.tau_e_min}, {self.tau_e_init}",
            ),
            (
                0 < self.gate_temperature_min <= self.gate_temperature,
                "need 0 < gate_temperature_min <= gate_temperature, got "
                f"{self.gate_temperature_min}, {self.gate_temperature}",
            ),
            (self.max_delta > 0, f"max_delta must be positive, got {self.max_delta}"),
            (
                min(self.load_balance_weight, self.expert_weight, self.score_jitter) >= 0,
                "load_balance_weight, expert_weight and score_jitter must be >= 0",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        _ = self.curriculum  # validates the boundaries

    @property
    def curriculum(self) -> AGRCurriculum:
        return AGRCurriculum(
            alpha_start=self.alpha_start,
            alpha_end=self.alpha_end,
            beta_start=self.beta_start,
            beta_end=self.beta_end,
            entropy_weight=self.entropy_weight,
            entropy_anneal_end=self.entropy_anneal_end,
            unit=self.schedule_unit,
            single_schedule=self.single_schedule,
        )


@dataclass
class RoutedParts:
    """Every intermediate of one routed score matrix (for the loss, logging and tests).

    s_e [R, C] ``S_E`` (cos / tau_E); s_h [R, C] ``S_H``; route_logits [R, C] (``w = sigmoid``);
    gate, calibration: the query side's, broadcast-shaped; s_agr [R, C] the routed score."""

    s_e: Tensor
    s_h: Tensor
    route_logits: Tensor
    gate: Tensor
    calibration: Tensor
    s_agr: Tensor


class ResidualTrunk(nn.Module):
    """``h = f + W f`` with ``W`` (and its bias) zero-initialised: starts as the identity."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, features: Tensor) -> Tensor:
        return features + self.proj(features)


@register
class AGR(HyperbolicRecipe):
    name = "agr"
    #: seed 000, retrieval table: R@5 and R@10
    reported_recall_ks = (5, 10)
    #: AGR Sec. 6 "Training" and Table 7: AdamW lr 1e-4, weight decay 0.1, cosine decay to 1e-6
    #: (ratio 0.01), gradient clipping at norm 1.0; no learning-rate warm-up is stated (Table 7's
    #: T_w is the router curriculum, which the recipe runs itself)
    train_defaults = {
        "lr": 1e-4,
        "weight_decay": 0.1,
        "warmup": 0.0,
        "min_lr_ratio": 0.01,
        "grad_clip": 1.0,
    }
    Config = AGRConfig
    embedding_geometry = {"euclidean": "sphere", "lorentz": "lorentz", "context": "features"}
    # buffers (registered in __init__): the curriculum of the last step, and w at warm-up's end
    alpha: Tensor
    beta: Tensor
    routing_weight_at_warmup_end: Tensor
    hyperbolic_key = "lorentz"
    #: Table 1: only the hyperbolic head sends gradient into the backbone (the Euclidean LoRA
    #: reads ``sg(h)``, router, contexts, gates and calibration read ``sg(h)`` and detached
    #: scores): with trainable towers in front, the towers train through ``lorentz`` alone
    trunk_gradient_keys = ("lorentz",)
    scale_knobs = ("tangent_scale", "image_tangent_scale", "text_tangent_scale")
    temperature_knob = "tau_h_init"
    #: runs saved before head_init existed started at random heads
    saved_config_defaults = {"head_init": "paper"}
    #: how far (R@1 points) the step-0 validation mean R@1 may lie from the alignment's
    #: (tests/test_warm_start.py): a fresh model ranks by the Lorentz expert alone (alpha = 0),
    #: whose ``-d_L`` sees the mapped images' norm spread, as MERU's (``warm_start``); the
    #: largest gap measured on the test stores over three world seeds is 2.5, plus a margin
    warm_start_tolerance = 4.0

    @staticmethod
    def tangent_shrink(
        config: AGRConfig, side: str, in_dim: int, feature_norm: float | None = None
    ) -> float:
        """The factor on ``W_H`` of ``side``: given (``{side}_tangent_scale``, then
        ``tangent_scale``), or the one that puts the step-0 tangent norm at 1 for features of
        mean norm ``feature_norm`` (None: the papers' features, norm sqrt(D)): through the
        random projection (gain ``sqrt(embed_dim / D)``) under head_init=paper, through the
        alignment's (gain 1: it keeps the mean norm) under align."""
        given = getattr(config, f"{side}_tangent_scale")
        if given is not None:
            return given
        if config.tangent_scale is not None:
            return config.tangent_scale
        if config.head_init == "align":  # the alignment's projection keeps the mean norm
            in_dim = config.embed_dim
        return resolve_tangent_scale(1.0, feature_norm, in_dim, config.embed_dim)

    def warm_start(self, alignment: LinearAlignment) -> str:
        """Both experts at ``alignment.projections(embed_dim)``: the Euclidean expert's frozen
        LoRA base (its update ``B A`` starts at zero, so the expert's cosine is the alignment's,
        exactly where ``embed_dim`` >= the text width), the Lorentz expert's ``W_H`` times the
        resolved tangent scale (mean tangent norm 1, inside the clip radius). The router starts
        neutral: its output layer at zero (``w = 0.5`` for every pair, the load-balance target)
        and the query gates' weights at zero (``g = 0.5`` for every query; the calibration is
        already the identity).

        How close: a fresh model has ``alpha = 0``, so it ranks by ``S_H = -d_L`` of the
        Lorentz expert alone: monotone in the alignment's angle for points at one radius, but
        the ridge map spreads the images' norms (as for MERU), so close, not equal."""
        cfg: AGRConfig = self.config
        image_proj, text_proj = alignment.projections(cfg.embed_dim)
        sides = (
            ("image", image_proj, self.image_euclidean, self.image_lorentz, self.image_query),
            ("text", text_proj, self.text_euclidean, self.text_lorentz, self.text_query),
        )
        with torch.no_grad():
            for side, proj, euclidean, hyperbolic, query in sides:
                if euclidean.in_features != proj.shape[0]:
                    raise ValueError(
                        f"agr: the warm start was fit on {proj.shape[0]}-d {side} features, "
                        f"the heads take {euclidean.in_features}-d"
                    )
                base = euclidean.base_weight
                assert isinstance(base, Tensor)
                base.copy_(proj.T.to(base.dtype))
                euclidean.lora_B.zero_()
                shrink = self.tangent_shrink(cfg, side, proj.shape[0])
                weight = hyperbolic.proj.weight
                weight.copy_((proj.T * shrink).to(weight.dtype))
                query.gate.weight.zero_()
                query.gate.bias.zero_()
            out_layer = self.router.tail[-1]
            assert isinstance(out_layer, nn.Linear)
            out_layer.weight.zero_()
            out_layer.bias.zero_()
        return "experts at the alignment, router neutral (w = g = 0.5); " + start_agreement(
            self, alignment
        )

    @classmethod
    def resolve_init(cls, config: AGRConfig, norms: FeatureNorms) -> dict[str, Any]:
        return {
            "image_tangent_scale": round_resolved(
                cls.tangent_shrink(config, "image", norms.image_dim, norms.image_norm)
            ),
            "text_tangent_scale": round_resolved(
                cls.tangent_shrink(config, "text", norms.text_dim, norms.text_norm)
            ),
        }

    def __init__(self, config: AGRConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        cfg = config
        self.curriculum = cfg.curriculum
        if cfg.trunk == "residual":
            self.image_trunk: nn.Module = ResidualTrunk(image_dim)
            self.text_trunk: nn.Module = ResidualTrunk(text_dim)
        else:
            self.image_trunk, self.text_trunk = nn.Identity(), nn.Identity()
        self.image_euclidean = LoRALinear(
            image_dim, cfg.embed_dim, rank=cfg.lora_rank, alpha=cfg.lora_alpha
        )
        self.text_euclidean = LoRALinear(
            text_dim, cfg.embed_dim, rank=cfg.lora_rank, alpha=cfg.lora_alpha
        )
        # Eq. 5 has no scale before the exp map: the head's scale is fixed at 1 and the
        # curvature-dependent clip (|v| sqrt(c) <= kappa) is applied in _embed, where c is known.
        # W_H starts with outputs of norm about ``tangent_scale * sqrt(d)`` (1 by default), inside
        # the clip radius kappa / sqrt(c) = 3.2 at c = 0.1: the clip is then the safety bound it is
        # meant to be; at the default Linear scale every point would start clipped onto one
        # sphere around the origin, where the distance to the origin carries nothing.
        self.image_lorentz, self.text_lorentz = (
            LorentzHead(
                dim,
                cfg.embed_dim,
                scale_init=1.0,
                scale_max=None,
                learn_scale=False,
                clip_norm=None,
            )
            for dim in (image_dim, text_dim)
        )
        with torch.no_grad():
            self.image_lorentz.proj.weight.mul_(self.tangent_shrink(cfg, "image", image_dim))
            self.text_lorentz.proj.weight.mul_(self.tangent_shrink(cfg, "text", text_dim))
        self.curvature = LearnableScalar(
            cfg.curvature_init,
            min=cfg.curvature_min,
            max=cfg.curvature_max,
            learnable=cfg.learn_curvature,
        )
        self.tau_e = LearnableScalar(cfg.tau_e_init, min=cfg.tau_e_min, learnable=cfg.learn_tau_e)
        # only built when used, so runs saved before the option load unchanged
        self.tau_h = (
            LearnableScalar(cfg.tau_h_init, min=cfg.tau_h_min, learnable=cfg.learn_tau_h)
            if cfg.learn_tau_h or cfg.tau_h_init != 1.0
            else None
        )
        self.router = PairwiseRouter(
            image_dim,
            text_dim,
            context_dim=cfg.context_dim,
            hidden_dims=(cfg.router_hidden[0], cfg.router_hidden[1]),
            dropout=cfg.router_dropout,
            gate_temperature=cfg.gate_temperature,
            min_gate_temperature=cfg.gate_temperature_min,
            learn_gate_temperature=cfg.learn_gate_temperature,
            jitter=cfg.score_jitter,
        )
        self.image_query = QueryConditioner(image_dim)  # G_I, C_I
        self.text_query = QueryConditioner(text_dim)  # G_T, C_T
        # Curriculum state of the last step, saved with the model so that a checkpoint ranks
        # with the score it was trained with; the warm-up diagnostic is NaN until measured.
        self.register_buffer("alpha", torch.zeros(()))
        self.register_buffer("beta", torch.zeros(()))
        self.register_buffer("routing_weight_at_warmup_end", torch.full((), math.nan))

    # --- embeddings ---------------------------------------------------------------------------
    def _embed(
        self,
        features: Tensor,
        trunk: nn.Module,
        euclidean: LoRALinear,
        hyperbolic: LorentzHead,
        query: QueryConditioner,
        context: Callable[[Tensor], Tensor],
        dim: int,
        what: str,
    ) -> Embedding:
        if not isinstance(features, Tensor) or features.ndim != 2 or features.shape[1] != dim:
            shape = (
                tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            )
            raise ValueError(f"agr: {what} features must have shape [N, {dim}], got {shape}")
        h = trunk(features)
        c = self.curvature()
        tangent = clip_tangent_norm(hyperbolic.tangent(h), self.config.clip_kappa / c.sqrt())
        gate_logit = query.gate(h.detach()).squeeze(-1)
        calibration_logit = query.calibration(h.detach())
        return {
            "euclidean": sphere.project(euclidean(h.detach()), 1.0),
            "lorentz": lorentz.expmap0(tangent, c),
            "context": context(h),
            "gate_logit": gate_logit,
            "calibration_logit": calibration_logit,
        }

    def embed_images(self, features: Tensor) -> Embedding:
        return self._embed(
            features,
            self.image_trunk,
            self.image_euclidean,
            self.image_lorentz,
            self.image_query,
            self.router.image_context,
            self.image_dim,
            "image",
        )

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return self._embed(
            features,
            self.text_trunk,
            self.text_euclidean,
            self.text_lorentz,
            self.text_query,
            self.router.text_context,
            self.text_dim,
            "text",
        )

    # --- scores -------------------------------------------------------------------------------
    def routed(
        self,
        texts: Embedding,
        images: Embedding,
        query: Query,
        alpha: float | None = None,
        beta: float | None = None,
    ) -> RoutedParts:
        """The routed score matrix [Nt, Ni] and its parts; ``alpha``/``beta`` default to the
        values of the last training step."""
        _check_query(query)
        alpha = float(self.alpha) if alpha is None else alpha
        beta = float(self.beta) if beta is None else beta
        s_e, s_h, logits = self._expert_scores_and_logits(texts, images, beta, pairs=False)
        gate, calibration = self._query_conditioning(texts if query == "text" else images)
        if query == "text":  # one gate per row of the [Nt, Ni] matrix
            gate, calibration = gate[:, None], calibration[:, None, :]
        else:  # one per column
            gate, calibration = gate[None, :], calibration[None, :, :]
        s_agr = self._routed_score(s_e, s_h, logits, gate, calibration, alpha, beta)
        return RoutedParts(s_e, s_h, logits, gate, calibration, s_agr)

    def _expert_scores_and_logits(
        self, texts: Embedding, images: Embedding, beta: float, pairs: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``S_E``, ``S_H`` and the router's logits: of every (text, image) pair, ``[Nt, Ni]``
        (``pairs=False``), or of given pairs (``pairs=True``: shapes broadcast as in
        :meth:`pair_scores`)."""
        cosine = cosine_pair_scores if pairs else cosine_scores
        distance = lorentz_distance_pair_scores if pairs else lorentz_distance_scores
        router = self.router.pair_logits if pairs else self.router.matrix_logits
        s_e = cosine(texts["euclidean"], images["euclidean"]) / self.tau_e()
        s_h = distance(texts["lorentz"], images["lorentz"], self.curvature())
        s_h = s_h if self.tau_h is None else s_h / self.tau_h()
        logits = router(beta * s_e, s_h, texts["context"], images["context"])
        return s_e, s_h, logits

    @staticmethod
    def _query_conditioning(side: Embedding) -> tuple[Tensor, Tensor]:
        """The query side's gate ``g`` [N] and calibration ``(wE, sH, sE)`` [N, 3] (Eq. 15),
        decoded from the logits its embedding carries."""
        return torch.sigmoid(side["gate_logit"]), 2.0 * torch.sigmoid(side["calibration_logit"])

    def _routed_score(
        self,
        s_e: Tensor,
        s_h: Tensor,
        logits: Tensor,
        gate: Tensor,
        calibration: Tensor,
        alpha: float,
        beta: float,
    ) -> Tensor:
        return routed_scores(
            s_h,
            s_e,
            torch.sigmoid(logits),
            gate,
            calibration,
            alpha,
            self._delta_beta(beta),
            self.config.max_delta,
        )

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return self.routed(texts, images, query).s_agr

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        """Routed score of given pairs. Matched rows: every tensor ``[n, ...]`` -> ``[n]``.
        Top-K rerank: texts ``[n, 1, ...]`` against images ``[n, K, ...]`` (or the other way
        round) -> ``[n, K]``; the query side's gate and calibration are used."""
        _check_query(query)
        alpha, beta = float(self.alpha), float(self.beta)
        s_e, s_h, logits = self._expert_scores_and_logits(texts, images, beta, pairs=True)
        gate, calibration = self._query_conditioning(texts if query == "text" else images)
        return self._routed_score(s_e, s_h, logits, gate, calibration, alpha, beta)

    def _delta_beta(self, beta: float) -> float:
        """The beta inside the correction: Algorithm 1 throttles ``S_E`` there too; Eqs. 16/21
        use the raw ``S_E`` (beta only on the router's input)."""
        return beta if self.config.delta_form == "algorithm1" else 1.0

    def routing_summary(self, texts: Embedding, images: Embedding) -> dict[str, float]:
        """Router statistics over matched rows (text i belongs with image i), text queries:
        w_mean (mean w over all pairs, Definition 5.2's w-bar), w_pos (the diagonal), w_neg (off
        the diagonal), gate (mean query gate g), euclidean_share (m-bar = mean of
        alpha g w w_E over all pairs: how much of the Euclidean correction reaches S_AGR),
        euclidean_share_pos (the same on the diagonal), e_above_h (share of pairs with
        beta S_E > S_H, the score offset Prop. 5.1 says w follows), alpha, beta."""
        with torch.no_grad():
            parts = self.routed(texts, images, "text")
            w = torch.sigmoid(parts.route_logits.float())
            n = w.shape[0]
            diag = torch.eye(n, dtype=torch.bool)
            alpha = float(self.alpha)
            share = alpha * parts.gate * w * parts.calibration[..., 0]
            return {
                "w_mean": float(w.mean()),
                "w_pos": float(w[diag].mean()),
                "w_neg": float(w[~diag].mean()) if n > 1 else float("nan"),
                "gate": float(parts.gate.mean()),
                "euclidean_share": float(share.mean()),
                "euclidean_share_pos": float(share[diag].mean()),
                "e_above_h": float((float(self.beta) * parts.s_e > parts.s_h).float().mean()),
                "alpha": alpha,
                "beta": float(self.beta),
            }

    def class_embedding(self, prompts: Embedding) -> Embedding:
        """A class from its prompts: mean direction (Euclidean, renormalised), mean tangent vector
        (Lorentz, MERU's protocol), mean context, gate and calibration logits (all linear in the
        features, so these equal the values of the mean prompt feature)."""
        c = self.curvature()
        return {
            "euclidean": sphere.project(prompts["euclidean"].mean(0, keepdim=True), 1.0),
            "lorentz": lorentz.tangent_mean(prompts["lorentz"], c),
            "context": prompts["context"].mean(0, keepdim=True),
            "gate_logit": prompts["gate_logit"].mean(0, keepdim=True),
            "calibration_logit": prompts["calibration_logit"].mean(0, keepdim=True),
        }

    # --- training -----------------------------------------------------------------------------
    def _curriculum_at(self, progress: Progress) -> tuple[float, float]:
        """``(alpha(t), beta(t))`` of the four-phase curriculum at this step."""
        return (
            agr_alpha(progress.step, progress.total, self.curriculum),
            agr_beta(progress.step, progress.total, self.curriculum),
        )

    def on_step_start(self, progress: Progress) -> None:
        """Record this step's curriculum in the buffers that scoring outside training reads
        (the loss takes its values from ``progress`` itself, so a loop that calls ``loss``
        without this hook still trains with the right curriculum)."""
        alpha, beta = self._curriculum_at(progress)
        self.alpha.fill_(alpha)
        self.beta.fill_(beta)

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        cfg: AGRConfig = self.config
        if batch.image.shape[0] != batch.text.shape[0]:
            raise ValueError(
                f"agr: batch has {batch.image.shape[0]} images but {batch.text.shape[0]} "
                "texts; rows must be matched pairs"
            )
        alpha, beta = self._curriculum_at(progress)
        local_images, local_texts = self.embed_images(batch.image), self.embed_texts(batch.text)
        all_images, all_texts = gather(local_images), gather(local_texts)
        offset = gather.offset(batch.image.shape[0])

        if gather.world_size == 1:
            # one process: both directions score the same pairs, so the scores and the router
            # weights are shared and both routed scores come from one (fused) pass
            s_e, s_h, logits = self._expert_scores_and_logits(
                local_texts, all_images, beta, pairs=False
            )
            s_t2i, s_i2t = routed_scores_both(
                s_h,
                s_e,
                torch.sigmoid(logits),
                *self._query_conditioning(local_texts),
                *self._query_conditioning(local_images),
                alpha,
                self._delta_beta(beta),
                cfg.max_delta,
            )
            s_e_i2t, s_h_i2t = s_e, s_h
        else:
            # text -> image: local text rows against all images; image -> text: all texts
            # against local images, with the image side as query
            t2i = self.routed(local_texts, all_images, "text", alpha, beta)
            i2t = self.routed(all_texts, local_images, "image", alpha, beta)
            s_e, s_h, logits, s_t2i = t2i.s_e, t2i.s_h, t2i.route_logits, t2i.s_agr
            s_e_i2t, s_h_i2t, s_i2t = i2t.s_e, i2t.s_h, i2t.s_agr
        contrastive = symmetric_info_nce(s_t2i, s_i2t.T, temperature=1.0, offset=offset)

        with torch.no_grad() if cfg.expert_weight == 0 else torch.enable_grad():
            loss_e = symmetric_info_nce(s_e, s_e_i2t.T, temperature=1.0, offset=offset)
            loss_h = symmetric_info_nce(s_h, s_h_i2t.T, temperature=1.0, offset=offset)

        entropy = routing_entropy(logits)
        mean_w = gather.average(torch.sigmoid(logits.float()).mean())
        lam_ent = agr_entropy_weight(progress.step, progress.total, self.curriculum)
        terms = {
            "contrastive": contrastive,
            "entropy": -lam_ent * entropy,
            "load_balance": cfg.load_balance_weight * load_balance(mean_w),
        }
        if cfg.expert_weight > 0:
            terms["expert_euclidean"] = cfg.expert_weight * loss_e
            terms["expert_hyperbolic"] = cfg.expert_weight * loss_h
        total = cast(Tensor, sum(terms.values()))

        mean_w_value = float(mean_w.detach())
        if math.isnan(
            float(self.routing_weight_at_warmup_end)
        ) and progress.step >= agr_warmup_end_step(progress.total, self.curriculum):
            self.routing_weight_at_warmup_end.fill_(mean_w_value)
        gate_text = float(torch.sigmoid(local_texts["gate_logit"].detach()).mean())
        gate_image = float(torch.sigmoid(local_images["gate_logit"].detach()).mean())
        logs = {
            **self.log_values(),  # first: this step's curriculum below overrides the buffers'
            "routing_weight": mean_w_value,
            "gate": 0.5 * (gate_text + gate_image),
            "gate/text": gate_text,
            "gate/image": gate_image,
            "alpha": alpha,
            "beta": beta,
            "phase": float(agr_phase_index(progress.step, progress.total, self.curriculum)),
            "entropy_weight": lam_ent,
            "routing_entropy": float(entropy.detach()),
            "loss_euclidean": float(loss_e.detach()),
            "loss_hyperbolic": float(loss_h.detach()),
        }
        return LossOutput(total=total, terms=terms, logs=logs)

    # --- geometry questions -------------------------------------------------------------------
    def index_proxies(self) -> dict[str, IndexProxy]:
        """Candidates from one expert (default the Lorentz one's distance, or the Euclidean one's
        cosine), reranked with the routed score: the router runs on the candidates only."""
        return {
            "lorentz": IndexProxy("lorentz", "lorentz"),
            "cosine": IndexProxy("cosine", "euclidean"),
        }

    def embedding_diagnostics(
        self, images: Embedding, texts: Embedding
    ) -> dict[str, dict[str, Tensor]]:
        """The query gate ``g = sigmoid(Gate(sg h))`` per item (Sec. 4.2)."""
        return {
            "query_gate": {
                "image": torch.sigmoid(images["gate_logit"].double().flatten()),
                "text": torch.sigmoid(texts["gate_logit"].double().flatten()),
            }
        }

    # --- logging ------------------------------------------------------------------------------
    def log_values(self) -> dict[str, float]:
        out = {
            **self.curvature.summary("curvature"),
            **self.tau_e.summary("tau_e"),
            **(self.tau_h.summary("tau_h") if self.tau_h is not None else {}),
            **self.router.temperature.summary("router_temperature"),
            "alpha": float(self.alpha),
            "beta": float(self.beta),
        }
        w = float(self.routing_weight_at_warmup_end)
        if not math.isnan(w):
            out["routing_weight_at_warmup_end"] = w
            out["dominance_at_warmup_end"] = 1.0 if w > 0.9 else (-1.0 if w < 0.1 else 0.0)
        return out

    @classmethod
    def search_space(cls) -> dict:
        """Shared nuisance knobs (the curvature's init and learned/fixed included), the Euclidean
        and hyperbolic temperatures, the Lorentz head's step-0 tangent scale, and the
        curriculum's length: ``curriculum_scale`` stretches the paper's four boundaries (alpha
        2.5K-5K, beta 5K-10K of 120K steps, as fractions) together, so a short run can give the
        router a longer warm-up (``search_overrides``). The step-0 check names ``tau_h_init``
        and the tangent scales when the logits are flat or the curvature inert: both are here
        (``tangent_scale_factor`` multiplies the per-side scales resolved from the features, so
        the data-aware ratio between the sides is kept)."""
        from curvalign.recipes.base import Knob, shared_search_space

        return {
            **shared_search_space(cls),
            "tau_e_init": Knob("float", 0.02, 0.2, log=True, why="CLIP's 0.07 within about 3x"),
            "tau_h_init": Knob(
                "float", 0.02, 2.0, log=True, why="Eq. 9's 1 (S_H = -d_L) down to CLIP-like 0.02"
            ),
            "tangent_scale_factor": Knob(
                "float",
                0.3,
                3.0,
                log=True,
                why="x0.3 to x3 on the data-resolved step-0 tangent norm 1",
                default=1.0,
                factor_of=("image_tangent_scale", "text_tangent_scale"),
                covers=("tangent_scale",),
            ),
            "curriculum_scale": Knob(
                "float",
                0.5,
                8.0,
                log=True,
                role="method",
                why="paper boundaries x0.5 to x8",
                default=1.0,
            ),
        }

    def phase_steps(self, total: int) -> tuple[int, ...]:
        """The curriculum's boundaries in steps: alpha's and beta's ramps (the warm-up's end
        alone under ``single_schedule``)."""
        names = (
            ("alpha_end",)
            if self.curriculum.single_schedule
            else ("alpha_start", "alpha_end", "beta_start", "beta_end")
        )
        return tuple(sorted({math.ceil(self.curriculum.steps(n, total)) for n in names}))

    @classmethod
    def search_overrides(cls, params) -> dict:
        """``curriculum_scale`` -> the four curriculum boundaries (fractions of the run, capped
        at 0.9 so that every ramp ends inside the run); other knobs are config fields."""
        out = {k: v for k, v in params.items() if k != "curriculum_scale"}
        if "curriculum_scale" in params:
            scale = float(params["curriculum_scale"])
            for key in ("alpha_start", "alpha_end", "beta_start", "beta_end"):
                out[key] = min(0.9, getattr(AGRCurriculum, key) * scale)
        return out


def _check_query(query: str) -> None:
    if query not in ("text", "image"):
        raise ValueError(f"agr: query must be 'text' or 'image', got {query!r}")


__all__ = ["AGR", "AGRConfig", "RoutedParts", "ResidualTrunk"]
