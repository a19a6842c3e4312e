"""PHyCLIP (seed 002): an l1-product of k Lorentz factors, each with its own learnable curvature.

Embedding  {"point": [N, k, d]} Lorentz space components per factor.
Head       ``FactorizedLorentzHead``: a k*d projection sliced into k factors, a learnable scalar
           per modality (App. C.3: init 1/sqrt(k d), at most 1), ``expmap0`` per factor with
           curvature ``c[i]`` (init 1.0, clamped to [0.1, 10] per factor). ``head_init="align"``
           (default) starts the projection at the data's linear alignment (``warm_start``),
           "paper" at the random projection.
Score      ``-d_avg = -(1/k) sum_i d_{H_i}`` (Eq. 2), always: never the sum of per-factor inner
           products that the authors' zero-shot code uses (it does not rank like the training
           distance).
Loss       Eq. 1: ``L_cont + gamma L_ent``, gamma 0.2.
           Eq. 4: ``L_cont = 1/4 [CE(I, T) + CE(T, I) + CE(I_box, T_box) + CE(T_box, I_box)]`` on
           ``-d_avg / tau`` (tau init 0.07, floor 0.01), local rows vs gathered columns.
           Eq. 5-6: ``L_ent = sum over the pairs X <= Y of mean_b (1/k) sum_i max(0, phi(y_i, x_i)
           - eta omega(y_i))`` with the general side Y as the apex: I <= T and I_box <= T_box
           (eta 0.7), I <= I_box and T <= T_box (eta 1.2). App. C.3's "T <= I_box" is read as a
           typo for I <= I_box, following Eq. 6. The batch sum of Eq. 6 is a batch mean here
           (as in the authors' code; a sum would tie the loss scale to the batch size).
Zero-shot  per factor: ``expmap0`` of the mean of the prompts' tangent vectors.
Logged     temperature; the k curvatures as min / mean / max.
Analysis   ``factor_norms`` (factor-wise distance to the origin) and ``factor_max_compose``
           (the factor-wise max composition of Fig. 7).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from curvalign.data.alignment import LinearAlignment
from curvalign.data.statistics import FeatureNorms
from curvalign.geometry import lorentz
from curvalign.losses import entailment_cone_loss, info_nce
from curvalign.nn.heads import FactorizedLorentzHead, resolve_tangent_scale
from curvalign.recipes import register
from curvalign.recipes.base import (
    HEAD_SCALE_KNOBS,
    Batch,
    Embedding,
    Gather,
    HyperbolicRecipe,
    IndexProxy,
    LossOutput,
    Progress,
    Query,
    box_batch_points,
    check_batch,
    check_head_scale_settings,
    check_scalar_range,
    eta_cone_margin,
    head_scales,
    learnable_curvature,
    learnable_temperature,
    round_resolved,
    start_agreement,
)
from curvalign.scores import product_average_distance_pair_scores, product_average_distance_scores

#: (term name, local rows, gathered columns): Eq. 4's four directions.
CONTRASTIVE_PAIRS = (
    ("contrast_image_text", "image", "text"),
    ("contrast_text_image", "text", "image"),
    ("contrast_box_image_box_text", "box_image", "box_text"),
    ("contrast_box_text_box_image", "box_text", "box_image"),
)

#: (term name, general side = apex, specific side, which eta): Eq. 6's four pairs.
ENTAILMENT_PAIRS = (
    ("entail_text_image", "text", "image", "inter"),
    ("entail_box_text_box_image", "box_text", "box_image", "inter"),
    ("entail_box_image_image", "box_image", "image", "intra"),
    ("entail_box_text_text", "box_text", "text", "intra"),
)


#: PHyCLIP's head initialisations: the data's linear alignment, or the paper's random projection
HEAD_INITS_PHYCLIP = ("align", "paper")


@dataclass
class PhyclipConfig:
    """PHyCLIP's defaults (Sec. 4.1, App. C.3).

    num_factors, factor_dim  k = 64 factors of d = 8 dimensions (total 512)
    curvature_*              per-factor curvature init 1.0, clamped to [0.1, 10], learnable
    temperature_*            tau init 0.07, floor 0.01, learnable
    tangent_norm_init        the images' step-0 tangent norm the resolved scales aim at (1.0):
                             every factor's (``per_factor_scale``, the authors' code) or the
                             whole k*d vector's (one scale, App. C.3); for the papers' features
                             (norm sqrt(D)) the rule gives the papers' values, 1/sqrt(d) and
                             App. C.3's 1/sqrt(k d) (``nn.heads.resolve_tangent_scale``); what
                             tuning searches
    text_radius_ratio        texts' step-0 radius over the images' (1.0)
    image_scale_init, text_scale_init   each side's scale (None: resolved by that rule,
                             ``recipes.base.head_scales``; a run records the resolved values)
    scale_init               deprecated: ``scale_init=v`` reads as ``image_scale_init=v``,
                             ``text_scale_init=v * text_radius_ratio``
    scale_max                its upper bound (1, as MERU)
    per_factor_scale         one scale per factor (the authors' code, default: measured better at
                             k=16, docs/methods.md) instead of App. C.3's one per modality
    entailment_weight        gamma (0.2)
    eta_inter, eta_intra     0.7 (I <= T, I_box <= T_box), 1.2 (I <= I_box, T <= T_box)
    aperture_K               the cone constant K (0.1)
    head_init                "align" (default: the k*d projection starts at the data's linear
                             alignment, ``Phyclip.warm_start``) or "paper" (random, App. C.3)
    product_metric           "l1" (the method: ``d_avg``, mean of the factor distances) or "l2"
                             (Table 4's ablation: ``sqrt(mean_i d_{H_i}^2)``, the root mean
                             square, so the logit scale stays independent of k as for "l1")
    """

    num_factors: int = 64
    factor_dim: int = 8
    curvature_init: float = 1.0
    curvature_min: float = 0.1
    curvature_max: float = 10.0
    learn_curvature: bool = True
    temperature_init: float = 0.07
    temperature_min: float = 0.01
    learn_temperature: bool = True
    scale_init: float | None = None
    scale_max: float | None = 1.0
    per_factor_scale: bool = True
    entailment_weight: float = 0.2
    eta_inter: float = 0.7
    eta_intra: float = 1.2
    aperture_K: float = 0.1
    product_metric: Literal["l1", "l2"] = "l1"
    image_scale_init: float | None = None
    text_scale_init: float | None = None
    tangent_norm_init: float = 1.0
    head_init: str = "align"
    text_radius_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.head_init not in HEAD_INITS_PHYCLIP:
            raise ValueError(
                f"head_init must be one of {', '.join(HEAD_INITS_PHYCLIP)}, got {self.head_init!r}"
            )
        check_head_scale_settings(self)
        if self.product_metric not in ("l1", "l2"):
            raise ValueError(f"product_metric must be 'l1' or 'l2', got {self.product_metric!r}")
        if self.num_factors <= 0 or self.factor_dim <= 0:
            raise ValueError(
                f"num_factors and factor_dim must be positive, got {self.num_factors}, "
                f"{self.factor_dim}"
            )
        check_scalar_range("curvature", self.curvature_init, self.curvature_min, self.curvature_max)
        check_scalar_range("temperature", self.temperature_init, self.temperature_min)


@register
class Phyclip(HyperbolicRecipe):
    name = "phyclip"
    #: seed 002: R@5 and R@10, as MERU and HyCoCLIP
    reported_recall_ks = (5, 10)
    Config = PhyclipConfig
    embedding_geometry = {"point": "lorentz-product"}
    requires = frozenset({"boxes"})
    #: PHyCLIP App. C.3: AdamW lr 5e-4, weight decay 0.2,
    #: warm-up 4000 of 500000 steps, cosine to 0, no clipping
    train_defaults = {
        "lr": 5e-4,
        "weight_decay": 0.2,
        "warmup": 0.008,
        "min_lr_ratio": 0.0,
        "grad_clip": 0.0,
    }

    scale_knobs = HEAD_SCALE_KNOBS
    temperature_knob = "temperature_init"
    #: runs saved before head_init existed started at the paper's random projection
    saved_config_defaults = {"head_init": "paper"}
    #: how far (R@1 points) the step-0 validation mean R@1 may lie from the alignment's
    #: (tests/test_warm_start.py): the l1 of k factor distances is not a function of the
    #: alignment's angle (see ``warm_start``); the largest gap measured on the test stores over
    #: three world seeds is 5.5, plus a margin of about three validation images
    warm_start_tolerance = 7.0

    @staticmethod
    def head_scale(config: PhyclipConfig, in_dim: int, feature_norm: float | None) -> float:
        """Deprecated (removed in 0.3.0): the image side of ``head_scales_for``, which gives both
        sides' scales by the one rule."""
        warnings.warn(
            "Phyclip.head_scale is deprecated and removed in 0.3.0: use "
            "Phyclip.head_scales_for (both sides' scales by the one rule)",
            DeprecationWarning,
            stacklevel=2,
        )
        return Phyclip.head_scales_for(config, in_dim, in_dim, feature_norm, feature_norm)[0]

    @staticmethod
    def head_scales_for(
        config: PhyclipConfig,
        image_dim: int,
        text_dim: int,
        image_norm: float | None = None,
        text_norm: float | None = None,
    ) -> tuple[float, float]:
        """(image, text) scale by the one rule (``recipes.base.head_scales``), a side's
        target tangent norm reached per factor (``per_factor_scale``) or for the whole k*d
        vector, through the k*d projection (``resolve_tangent_scale``; a norm None = the papers'
        features): the random one (gain ``sqrt(k d / D)``) under head_init=paper, the
        alignment's (gain 1 for the whole vector, ``1/sqrt(k)`` per factor in root mean square:
        ``warm_start`` spreads the signal evenly) under align."""
        k, d = config.num_factors, config.factor_dim
        width = d if config.per_factor_scale else k * d
        inputs = {"image": (image_dim, image_norm), "text": (text_dim, text_norm)}

        def resolve(side: str, target: float) -> float:
            in_dim, norm = inputs[side]
            if config.head_init == "align":  # the projection keeps the mean norm: gain 1 over k*d
                in_dim = k * d
            return resolve_tangent_scale(target, norm, in_dim, width)

        return head_scales(config, resolve)

    def warm_start(self, alignment: LinearAlignment) -> str:
        """Both k*d projections at ``alignment.projections(k*d)``, sliced into k factors with
        the columns dealt round-robin (factor i holds the alignment's directions i, i+k, i+2k,
        ...: the leading directions spread over the factors, so every factor carries a like
        share of the signal and the scales, resolved for an even share, fit each), at the
        resolved scales and curvatures.

        How close: for small tangent vectors each factor distance is about the scaled
        Euclidean distance of its slice, so ``d_avg`` is about the mean over factors of
        ``|u_i - v_i|``, an l1 of slice norms, where the alignment's cosine ranks by the whole
        angle (an l2 over all slices at one norm). The two agree where the slices' differences
        are alike in size, and the ridge map's images spread in norm as for MERU: close to the
        alignment, not equal (the returned line gives both on train captions)."""
        k, d = self.config.num_factors, self.config.factor_dim
        image_proj, text_proj = alignment.projections(k * d)
        # column m*k + i of the alignment -> factor i, coordinate m
        order = torch.arange(k * d).reshape(d, k).T.reshape(-1)
        with torch.no_grad():
            for head, proj in ((self.image_head, image_proj), (self.text_head, text_proj)):
                if head.proj.weight.shape[1] != proj.shape[0]:
                    raise ValueError(
                        f"the warm start was fit on {proj.shape[0]}-d features, the head takes "
                        f"{head.proj.weight.shape[1]}-d"
                    )
                head.proj.weight.copy_(proj[:, order].T.to(head.proj.weight.dtype))
                if head.proj.bias is not None:
                    head.proj.bias.zero_()
        return f"{k} Lorentz factors at the alignment's interleaved slices; " + start_agreement(
            self, alignment
        )

    @classmethod
    def resolve_init(cls, config: PhyclipConfig, norms: FeatureNorms) -> dict[str, Any]:
        image, text = cls.head_scales_for(
            config, norms.image_dim, norms.text_dim, norms.image_norm, norms.text_norm
        )
        out: dict[str, Any] = {
            "image_scale_init": round_resolved(image),
            "text_scale_init": round_resolved(text),
        }
        if config.scale_max is not None and max(out.values()) > config.scale_max:
            out["scale_max"] = max(out.values())
        return out

    def logit_temperature(self, progress: Progress) -> float:
        return float(self.temperature.value)

    def __init__(self, config: PhyclipConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        image_scale, text_scale = self.head_scales_for(config, image_dim, text_dim)
        scale_max = config.scale_max
        if scale_max is not None:
            scale_max = max(scale_max, image_scale, text_scale)
        self.image_head, self.text_head = (
            FactorizedLorentzHead(
                dim,
                num_factors=config.num_factors,
                factor_dim=config.factor_dim,
                scale_init=scale,
                scale_max=scale_max,
                per_factor_scale=config.per_factor_scale,
            )
            for dim, scale in ((image_dim, image_scale), (text_dim, text_scale))
        )
        self.curvature = learnable_curvature(config, shape=(config.num_factors,))
        self.temperature = learnable_temperature(config)

    # --- embeddings and ranking ---------------------------------------------------------------
    def embed_images(self, features: Tensor) -> Embedding:
        return {"point": self.image_head(features, self.curvature())}

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return {"point": self.text_head(features, self.curvature())}

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return self._score_matrix(texts["point"], images["point"], self.curvature())

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        if self.config.product_metric == "l2":
            d = lorentz.dist(texts["point"], images["point"], self.curvature())  # [n, k]
            return -_rms(d.square().mean(-1))
        return product_average_distance_pair_scores(
            texts["point"], images["point"], self.curvature()
        )

    def _score_matrix(self, x: Tensor, y: Tensor, c: Tensor) -> Tensor:
        """[N, k, d], [M, k, d] -> [N, M]: ``-d_avg`` (l1) or ``-sqrt(mean_i d_i^2)`` (l2, summed
        one factor at a time: no [k, N, M] tensor)."""
        if self.config.product_metric == "l1":
            return product_average_distance_scores(x, y, c)
        k = x.shape[-2]
        cc = c.reshape(-1).expand(k) if c.numel() == 1 else c.reshape(-1)
        total = x.new_zeros(x.shape[0], y.shape[0])
        for i in range(k):
            total = total + lorentz.pairwise_dist(x[:, i], y[:, i], cc[i]).square()
        return -_rms(total / k)

    def class_embedding(self, prompts: Embedding) -> Embedding:
        return {"point": lorentz.tangent_mean(prompts["point"], self.curvature())}  # [1, k, d]

    # --- geometry questions and analysis -------------------------------------------------------
    entailment_measure = (
        "cone margin eta aper - ext per factor, mean over factors (Eq. 5-6 without the hinge; "
        "eta_inter for an image, eta_intra for a text)"
    )

    def entailment_scores(
        self, general: Embedding, specific: Embedding, specific_modality: Query = "image"
    ) -> Tensor:
        return eta_cone_margin(self, general, specific, specific_modality)

    def index_proxies(self) -> dict[str, IndexProxy]:
        """Per factor ``c_f <x_f, y_f>_L = -cosh(sqrt(c_f) d_f)``, summed: ranks like the sum of
        ``cosh`` of the factor distances, not like their sum, so candidates are reranked."""
        return {"product-lorentz": IndexProxy("product-lorentz", "point")}

    def factor_activation(self, emb: Embedding) -> Tensor | None:
        """[N, k] float64 distance of each factor to its origin (Fig. 3-4's factor-wise norms)."""
        points = emb.get("point")
        if points is None or points.ndim != 3:
            return None
        return lorentz.dist0(points.detach().double(), self.curvature_value())

    def factor_max_compose(self, a: Embedding, b: Embedding) -> Embedding:
        """Fig. 7 / App. D.2: per factor, keep whichever of ``a``'s and ``b``'s points lies further
        from the origin (a Boolean OR when each factor is a bit). Shapes [N, k, d] -> [N, k, d]."""
        norm_a, norm_b = self.factor_activation(a), self.factor_activation(b)
        if norm_a is None or norm_b is None:
            raise ValueError("factor_max_compose: expected embeddings with points [N, k, d]")
        pick_a = norm_a >= norm_b
        return {"point": torch.where(pick_a.unsqueeze(-1), a["point"], b["point"])}

    # --- training -----------------------------------------------------------------------------
    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name, boxes=True)
        cfg: PhyclipConfig = self.config
        c, tau = self.curvature(), self.temperature()
        local = box_batch_points(self.image_head, self.text_head, batch, c)
        everyone = gather(local)
        offset = gather.offset(batch.image.shape[0])
        terms = {}
        matrices: dict[tuple[str, str], torch.Tensor] = {}
        for name, rows, cols in CONTRASTIVE_PAIRS:
            if gather.world_size == 1 and (cols, rows) in matrices:
                # one process: the same pairs as the reverse direction, and the distance is
                # symmetric: reuse its matrix transposed (half the k x B x B work)
                scores = matrices[(cols, rows)].T
            else:
                scores = self._score_matrix(local[rows], everyone[cols], c)
            matrices[(rows, cols)] = scores
            terms[name] = 0.25 * info_nce(scores, temperature=tau, offset=offset)
        eta = {"inter": cfg.eta_inter, "intra": cfg.eta_intra}
        for name, parent, child, kind in ENTAILMENT_PAIRS:
            cone = entailment_cone_loss(
                local[parent], local[child], c, eta=eta[kind], K=cfg.aperture_K
            )
            terms[name] = cfg.entailment_weight * cone
        logs = {"temperature": float(tau.detach()), **self.curvature.summary("curvature")}
        return LossOutput(total=cast(Tensor, sum(terms.values())), terms=terms, logs=logs)

    def log_values(self) -> dict[str, float]:
        return {
            **self.temperature.summary("temperature"),
            **self.curvature.summary("curvature"),
            **self.image_head.scale.summary("scale/image"),
            **self.text_head.scale.summary("scale/text"),
        }

    @classmethod
    def search_space(cls) -> dict:
        """Shared nuisance knobs plus the entailment weight gamma (paper 0.2)."""
        from curvalign.recipes.base import Knob, shared_search_space

        return {
            **shared_search_space(cls),
            "entailment_weight": Knob(
                "float", 0.01, 1.0, log=True, role="method", why="paper gamma 0.2, 20x/5x"
            ),
        }


def _rms(mean_square: Tensor) -> Tensor:
    """sqrt with a floor, so a zero distance (x = y) has a finite gradient."""
    return mean_square.clamp_min(torch.finfo(mean_square.dtype).eps).sqrt()


__all__ = ["CONTRASTIVE_PAIRS", "ENTAILMENT_PAIRS", "Phyclip", "PhyclipConfig"]
