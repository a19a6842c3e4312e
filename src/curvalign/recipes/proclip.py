"""ProCLIP (seed 003): a mixed-curvature product H x E x S with a weighted squared product metric.

Embedding  {"hyperbolic": [N, dH] Lorentz space components, "euclidean": [N, dE],
            "sphere": [N, dS] points of the sphere of radius R}; a part of dimension 0 is left
           out (the single-geometry baselines of Sec. 3.2: e.g. hyperbolic_dim=192, the others 0).
Head       ``MixedCurvatureHead``: one 2-layer MLP (hidden 512, ReLU) per part (Sec. 3.3). With
           ``head_init="align"`` (default) each part is a linear skip path started at the data's
           linear alignment plus the MLP as a residual branch starting at zero (``warm_start``);
           ``head_init="paper"`` is the paper's MLP alone (the parameters saved runs hold).
Score      ``s = -d_Z^2 = -(a_H d_H^2 + a_E |e1 - e2|^2 + a_S d_S^2)`` (Eq. 4, Sec. 2.2), the weights
           a learnable and positive (stored as logs, init 1).
Loss       Eq. 5: symmetric InfoNCE on ``s / tau`` with tau = 0.07 fixed (Sec. 3.3), as the mean of
           the two directions (Eq. 5 writes their sum over the batch).
Zero-shot  class embedding per part (the project's reading; the paper evaluates retrieval only):
           hyperbolic ``expmap0`` of the mean tangent vector, Euclidean mean, spherical mean
           projected back onto the sphere of radius R.
Curvature  c and R are fixed by default: Remark 1 makes the learnable weights the effective
           curvature scales; ``learn_curvature`` adds a learnable c in [curvature_min, curvature_max].
"One random caption per image per epoch" is the sampler's job (``data.sampling``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from curvalign.data.alignment import LinearAlignment
from curvalign.geometry import lorentz, sphere
from curvalign.losses import symmetric_info_nce
from curvalign.nn.heads import MixedCurvatureHead
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
    check_batch,
    check_scalar_range,
    learnable_curvature,
    learnable_temperature,
    start_agreement,
)
from curvalign.scores import mixed_sqdist_pair_scores, mixed_sqdist_scores

PARTS = ("hyperbolic", "euclidean", "sphere")


@dataclass
class ProclipConfig:
    """ProCLIP's defaults (Sec. 3.2-3.3).

    hyperbolic_dim, euclidean_dim, sphere_dim  d per part (64 x 3, the paper's smallest setting;
                                               sphere_dim is the ambient dimension of its points)
    hidden_dim                                 MLP hidden width (512)
    temperature_init, learn_temperature        tau 0.07, fixed
    temperature_min                            floor when learnt (0.01)
    weight_init, weight_min, weight_max        the metric weights a_H, a_E, a_S: init 1, bounds
    curvature_init, learn_curvature, ...       c of the hyperbolic part (1.0, fixed)
    sphere_radius                              R of the spherical part (1.0)
    normalize_inputs                           L2-normalise both feature sets before the heads
                                               (Sec. 3.2: "embeddings are L2-normalized")
    head_init                                  "align" (default: linear skip path at the data's
                                               alignment + zero-started MLP, the weights chosen
                                               to rank like it; ``Proclip.warm_start``) or
                                               "paper" (the MLPs at PyTorch's init)
    """

    hyperbolic_dim: int = 64
    euclidean_dim: int = 64
    sphere_dim: int = 64
    hidden_dim: int = 512
    temperature_init: float = 0.07
    temperature_min: float = 0.01
    learn_temperature: bool = False
    weight_init: float = 1.0
    weight_min: float = 1e-3
    weight_max: float = 1e3
    curvature_init: float = 1.0
    curvature_min: float = 0.1
    curvature_max: float = 10.0
    learn_curvature: bool = False
    sphere_radius: float = 1.0
    normalize_inputs: bool = True
    head_init: str = "align"

    def __post_init__(self) -> None:
        if self.head_init not in ("align", "paper"):
            raise ValueError(f"head_init must be 'align' or 'paper', got {self.head_init!r}")
        dims = (self.hyperbolic_dim, self.euclidean_dim, self.sphere_dim)
        if min(dims) < 0 or max(dims) == 0:
            raise ValueError(f"part dimensions must be >= 0 with at least one positive, got {dims}")
        if self.sphere_dim == 1:
            raise ValueError(
                "sphere_dim must be 0 or >= 2 (it is the ambient dimension of the sphere's points)"
            )
        check_scalar_range("temperature", self.temperature_init, self.temperature_min)
        check_scalar_range("weight", self.weight_init, self.weight_min, self.weight_max)
        check_scalar_range("curvature", self.curvature_init, self.curvature_min, self.curvature_max)
        if self.sphere_radius <= 0:
            raise ValueError(f"sphere_radius must be positive, got {self.sphere_radius}")


@register
class Proclip(HyperbolicRecipe):
    name = "proclip"
    #: seed 003, Table 1: R@1 and R@10 both ways
    reported_recall_ks = (1, 10)
    Config = ProclipConfig
    temperature_knob = "temperature_init"
    embedding_geometry = {"hyperbolic": "lorentz", "euclidean": "euclidean", "sphere": "sphere"}
    hyperbolic_key = "hyperbolic"
    #: ProCLIP Sec. 3.3: AdamW lr 1e-4, weight decay 1e-4, cosine with linear warm-up (5 epochs;
    #: the paper gives no epoch count, so the warm-up is 5% of the run), no clipping
    train_defaults = {
        "lr": 1e-4,
        "weight_decay": 1e-4,
        "warmup": 0.05,
        "min_lr_ratio": 0.0,
        "grad_clip": 0.0,
    }
    #: runs saved before normalize_inputs existed fed raw features to the heads; before
    #: head_init existed their heads were the paper's MLPs
    saved_config_defaults = {"normalize_inputs": False, "head_init": "paper"}
    #: how far (R@1 points) the step-0 validation mean R@1 may lie from the alignment's
    #: (tests/test_warm_start.py): the spherical part ranks exactly like the alignment's
    #: (reduced) cosine; the hyperbolic and Euclidean parts, kept at the weight ``warm_start``
    #: chooses, add what the norm spread of the mapped images does to them. The largest gap
    #: measured on the test stores over three world seeds is 4.4, plus a margin
    warm_start_tolerance = 6.0
    #: the hyperbolic and Euclidean weights' multiples of ``weight_init`` ``warm_start`` tries
    WEIGHT_FRACTIONS = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01)
    #: train R@1 points the chosen mixture may give up to keep larger H and E weights
    WEIGHT_SLACK_R1 = 1.0

    def __init__(self, config: ProclipConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)

        def head(in_dim: int) -> MixedCurvatureHead:
            return MixedCurvatureHead(
                in_dim,
                hyperbolic_dim=config.hyperbolic_dim,
                euclidean_dim=config.euclidean_dim,
                sphere_dim=config.sphere_dim,
                hidden_dim=config.hidden_dim,
                skip=config.head_init == "align",
            )

        self.image_head = head(image_dim)
        self.text_head = head(text_dim)
        self.parts = tuple(p for p in PARTS if self.image_head.dims[p] > 0)
        self.weights = torch.nn.ModuleDict(
            {
                p: LearnableScalar(config.weight_init, min=config.weight_min, max=config.weight_max)
                for p in self.parts
            }
        )
        self.temperature = learnable_temperature(config)
        self.curvature = learnable_curvature(config)

    def warm_start(self, alignment: LinearAlignment) -> str:
        """Each part's linear skip path at ``alignment.projections(d_part)`` (the same leading
        directions for every part), scaled so that the (normalised, where ``normalize_inputs``)
        train inputs map to mean norm 1: tangent norm about 1 at c = 1 for the hyperbolic part,
        unit scale for the Euclidean one; the MLPs' residual branches start at zero
        (``MixedCurvatureHead(skip=True)``).

        The weights: the spherical part's distance is ``R arccos`` of the alignment's cosine
        (exactly, where ``sphere_dim`` >= the text width; of its leading directions
        otherwise), so it ranks like the alignment; the hyperbolic and Euclidean distances also
        see the mapped images' norms, which the ridge map spreads. ``a_S`` stays at
        ``weight_init`` and ``a_H = a_E`` take the largest multiple of it in
        ``WEIGHT_FRACTIONS`` whose train mean R@1 lies within ``WEIGHT_SLACK_R1`` of the best
        multiple's (a weight near its floor trains slowly: Adam moves its log about one
        learning rate a step). Without a spherical part every weight stays at ``weight_init``.
        """
        from curvalign.data.alignment import mean_r1

        cfg: ProclipConfig = self.config
        images, texts, owner = alignment.train_pairs()
        sides = (
            (self.image_head, self._inputs(images.float()), 0),
            (self.text_head, self._inputs(texts.float()), 1),
        )
        with torch.no_grad():
            for part in self.parts:
                projections = alignment.projections(self.image_head.dims[part])
                for head, inputs, side in sides:
                    proj = projections[side]
                    if head.in_dim != proj.shape[0] or head.skips is None:
                        raise ValueError(
                            f"proclip: the warm start needs head_init=align heads on "
                            f"{proj.shape[0]}-d features (the head takes {head.in_dim}-d)"
                        )
                    norm = float(torch.linalg.vector_norm(inputs @ proj, dim=-1).mean())
                    head.skip_layer(part).weight.copy_(proj.T / max(norm, 1e-12))
            chosen = 1.0
            if "sphere" in self.parts and len(self.parts) > 1:
                c, radius = self.curvature(), cfg.sphere_radius
                emb_i = self.image_head(sides[0][1], c, radius)
                emb_t = self.text_head(sides[1][1], c, radius)
                tried = []
                for fraction in self.WEIGHT_FRACTIONS:
                    w = self._start_weights(fraction)
                    r1 = mean_r1(mixed_sqdist_scores(emb_t, emb_i, w, c, radius), owner)
                    tried.append((fraction, r1))
                best = max(r1 for _, r1 in tried)
                chosen = max(f for f, r1 in tried if r1 >= best - self.WEIGHT_SLACK_R1)
            for part, value in self._start_weights(chosen).items():
                self._weight(part).log_value.fill_(float(value.log()))
        weights = ", ".join(
            f"a_{p[0].upper()} {float(self._weight(p).value):.3g}" for p in self.parts
        )
        return f"skip paths at the alignment, MLPs at zero, {weights}; " + start_agreement(
            self, alignment
        )

    def _start_weights(self, fraction: float) -> dict[str, Tensor]:
        """{part: weight}: ``weight_init`` for the sphere, ``fraction`` of it for the others,
        inside the weights' bounds."""
        cfg: ProclipConfig = self.config
        return {
            p: torch.tensor(
                min(
                    cfg.weight_max,
                    max(cfg.weight_min, cfg.weight_init * (1.0 if p == "sphere" else fraction)),
                )
            )
            for p in self.parts
        }

    def logit_temperature(self, progress: Progress) -> float:
        return float(self.temperature.value)

    def _weight(self, part: str) -> LearnableScalar:
        """The learnable weight of ``part`` (an entry of the ``weights`` ModuleDict)."""
        weight = self.weights[part]
        assert isinstance(weight, LearnableScalar)
        return weight

    def _weights(self) -> dict[str, Tensor]:
        return {p: self._weight(p)() for p in self.parts}

    def index_proxies(self) -> dict[str, IndexProxy]:
        """``2 a_H <x,y>_L + a_E (2 e.e' - |e'|^2) + 2 a_S s.s'``: first-order in the hyperbolic and
        spherical parts, exact in the Euclidean one; candidates are reranked exactly."""
        with torch.no_grad():
            weights = {p: float(w) for p, w in self._weights().items()}
        return {"mixed": IndexProxy("mixed", None, weights=weights)}

    def _inputs(self, features: Tensor) -> Tensor:
        """[N, D] features as Sec. 3.2 feeds them to the heads: L2-normalised (unless turned off)."""
        if not self.config.normalize_inputs:
            return features
        return torch.nn.functional.normalize(features, dim=-1, eps=torch.finfo(features.dtype).eps)

    def embed_images(self, features: Tensor) -> Embedding:
        return self.image_head(self._inputs(features), self.curvature(), self.config.sphere_radius)

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return self.text_head(self._inputs(features), self.curvature(), self.config.sphere_radius)

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return mixed_sqdist_scores(
            texts, images, self._weights(), self.curvature(), self.config.sphere_radius
        )

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return mixed_sqdist_pair_scores(
            texts, images, self._weights(), self.curvature(), self.config.sphere_radius
        )

    def class_embedding(self, prompts: Embedding) -> Embedding:
        out: Embedding = {}
        c = self.curvature()
        if "hyperbolic" in prompts:
            out["hyperbolic"] = lorentz.tangent_mean(prompts["hyperbolic"], c)
        if "euclidean" in prompts:
            out["euclidean"] = prompts["euclidean"].mean(dim=0, keepdim=True)
        if "sphere" in prompts:
            out["sphere"] = sphere.project(
                prompts["sphere"].mean(dim=0, keepdim=True), self.config.sphere_radius
            )
        return out

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name)
        c, tau, w, radius = (
            self.curvature(),
            self.temperature(),
            self._weights(),
            self.config.sphere_radius,
        )
        images = self.image_head(self._inputs(batch.image), c, radius)
        texts = self.text_head(self._inputs(batch.text), c, radius)
        # One gather for both modalities: keys "image/<part>" and "text/<part>".
        packed = {f"image/{p}": v for p, v in images.items()} | {
            f"text/{p}": v for p, v in texts.items()
        }
        everyone = gather(packed)
        all_images = {p: everyone[f"image/{p}"] for p in images}
        all_texts = {p: everyone[f"text/{p}"] for p in texts}
        contrastive = symmetric_info_nce(
            mixed_sqdist_scores(images, all_texts, w, c, radius),
            mixed_sqdist_scores(texts, all_images, w, c, radius),
            temperature=tau,
            offset=gather.offset(batch.image.shape[0]),
        )
        logs = {
            "temperature": float(tau.detach()),
            **{f"weight/{p}": float(v.detach()) for p, v in w.items()},
        }
        return LossOutput(total=contrastive, terms={"contrastive": contrastive}, logs=logs)

    def log_values(self) -> dict[str, float]:
        out = {**self.temperature.summary("temperature"), **self.curvature.summary("curvature")}
        for p in self.parts:
            out.update(self._weight(p).summary(f"weight/{p}"))
        return out

    @classmethod
    def search_space(cls) -> dict:
        """Shared nuisance knobs (its curvature learned or fixed included) plus the initial
        weights of the three factor distances (learnable; the paper does not give their init)."""
        from curvalign.recipes.base import Knob, shared_search_space

        return {
            **shared_search_space(cls),
            "weight_init": Knob(
                "float", 0.1, 10.0, log=True, role="method", why="factor weights' init, 10x 1.0"
            ),
        }


__all__ = ["Proclip", "ProclipConfig"]
