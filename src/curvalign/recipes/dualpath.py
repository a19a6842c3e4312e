"""DualPath (viPolyQwen, seed 004): a soft two-expert projection with a text-first curriculum.

Head       ``curvalign.nn.dualpath.DualPathHead``: per-modality input adapters into a common
           width, learned task prefixes, shared ``Dropout(GELU(W_1 h))``, text path and
           multimodal path mixed by ``g = sigmoid(theta)`` (theta init -5) for image inputs only,
           residual ``a z + (1 - a) W_r h`` (a init 0.5); with ``pool_tokens`` the texts are
           token sequences attention-pooled (``curvalign.nn.pooling``, K = 4 queries) before
           the head: the recipe ``reads_text_tokens``, so training and evaluation feed every
           text (captions, pairs, prompts, negatives) as tokens + mask from the store's token
           groups. Images stay pooled vectors (stores hold no image tokens).
Embedding  {"point": [N, d]} unit vectors; the score is the cosine.
Curriculum ``curvalign.schedules.DualPathCurriculum``. Phase 1 (up to ``switch_at``, the paper's
           1M of 7.5M samples): scored text pairs only. At the first Phase-2 step
           ``on_step_start`` copies the text path into the multimodal path (once; a buffer
           records it, so a resumed run does not copy again) and the gate warms up over
           ``gate_warmup``. Temperature 0.1 -> 0.07, score weight 0.5 -> 3.0, rank weight
           0.1 -> 1.0 over ``loss_warmup`` (Sec. 4.4).
Loss       Phase 1: ``L_text = InfoNCE + lambda_s MSE(score) + lambda_r rank`` on text pairs
           (task prefix "text_pair"); Phase 2: ``L_text + L_visual`` with
           ``L_visual = InfoNCE + lambda_t triplet`` on image-caption pairs (task "image_text").
           The loss readings are in ``curvalign.losses.multiloss``.
Text tasks ``embed_texts(features, task="image_text")`` embeds captions for image retrieval (the
           default); ``task="text_pair"`` embeds texts for text-text similarity, as in training.
Logged     dualpath_gate (the effective g), dualpath_phase, gate_warmup, temperature,
           score_weight, rank_weight, residual_mix (a) and the unweighted loss parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from curvalign.data.alignment import LinearAlignment
from curvalign.geometry import sphere
from curvalign.losses.contrastive import symmetric_info_nce
from curvalign.losses.multiloss import (
    hardest_negative_triplet,
    pair_ranking,
    score_mse,
    score_weighted_info_nce,
)
from curvalign.nn.dualpath import TASKS, DualPathHead
from curvalign.nn.pooling import AttentionPooling
from curvalign.recipes import register
from curvalign.recipes.base import (
    Batch,
    CosineRecipe,
    Embedding,
    Gather,
    LossOutput,
    Progress,
    start_agreement,
    sum_terms,
)
from curvalign.schedules import (
    DualPathCurriculum,
    dualpath_gate_warmup,
    dualpath_loss_weights,
    dualpath_phase,
)
from curvalign.scores import cosine_pair_scores, cosine_scores

_CURRICULUM = DualPathCurriculum()


@dataclass
class DualPathConfig:
    """DualPath's settings; defaults from the paper where it gives them.

    model_dim, hidden_dim, embed_dim  widths of h, h' and the embedding (the paper: 2048, 4096,
                                      1024; the defaults keep its ratios at a quarter size)
    dropout                           dropout on the shared expansion (0.1; not given)
    gate_init                         theta_0 (-5.0: g = 0.0067)
    gate_speed                        learning-rate multiplier of theta (1.0; see
                                      ``curvalign.nn.dualpath``: lets a short run open the gate)
    phase2_text_pairs                 keep L_text in Phase 2 (True, the paper); False trains
                                      Phase 2 on image-caption pairs only (a study arm)
    residual_init                     a at initialisation (0.5)
    task_prefix                       learned per-task prefix vectors ("text_pair", "image_text")
    pool_tokens, pool_queries         texts are token sequences [N, L, Dk] (+ mask), attention-
                                      pooled with K queries (4); needs a store extracted with
                                      --tokens; off for pooled feature stores
    switch_at, gate_warmup, loss_warmup, schedule_unit   the curriculum (fractions of the run by
                                      default: 1/7.5, 1000 x 512 / 7.5M, 1/7.5)
    temperature_*, score_weight_*, rank_weight_*         Sec. 4.4's ramps
    triplet_weight, triplet_margin    lambda_t and the triplet margin (not given: 1.0, 0.2)
    head_init                         "align" (default: adapters and residual at the data's
                                      linear alignment, both paths' output layers at zero;
                                      ``DualPath.warm_start``) or "paper" (PyTorch's init);
                                      with ``pool_tokens`` the head starts at "paper" (the
                                      alignment is fit on the pooled text features)
    """

    model_dim: int = 512
    hidden_dim: int = 1024
    embed_dim: int = 256
    dropout: float = 0.1
    gate_init: float = -5.0
    gate_speed: float = 1.0
    phase2_text_pairs: bool = True
    residual_init: float = 0.5
    task_prefix: bool = True
    pool_tokens: bool = False
    pool_queries: int = 4
    switch_at: float = _CURRICULUM.switch_at
    gate_warmup: float = _CURRICULUM.gate_warmup
    loss_warmup: float = _CURRICULUM.loss_warmup
    schedule_unit: Literal["fraction", "steps"] = "fraction"
    temperature_start: float = _CURRICULUM.temperature_start
    temperature_end: float = _CURRICULUM.temperature_end
    score_weight_start: float = _CURRICULUM.score_weight_start
    score_weight_end: float = _CURRICULUM.score_weight_end
    rank_weight_start: float = _CURRICULUM.rank_weight_start
    rank_weight_end: float = _CURRICULUM.rank_weight_end
    triplet_weight: float = 1.0
    triplet_margin: float = 0.2
    head_init: str = "align"

    def __post_init__(self) -> None:
        if self.head_init not in ("align", "paper"):
            raise ValueError(f"head_init must be 'align' or 'paper', got {self.head_init!r}")
        if self.head_init == "align" and not self.residual_init < 1.0:
            raise ValueError(
                "head_init=align starts the embedding on the residual branch (1 - a) W_r h: "
                f"residual_init must be < 1, got {self.residual_init}"
            )
        if min(self.model_dim, self.hidden_dim, self.embed_dim, self.pool_queries) <= 0:
            raise ValueError(
                "model_dim, hidden_dim, embed_dim and pool_queries must be positive, got "
                f"{self.model_dim}, {self.hidden_dim}, {self.embed_dim}, {self.pool_queries}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.triplet_weight < 0 or self.triplet_margin < 0:
            raise ValueError("triplet_weight and triplet_margin must be >= 0")
        _ = self.curriculum  # validates the schedule values

    @property
    def curriculum(self) -> DualPathCurriculum:
        return DualPathCurriculum(
            switch_at=self.switch_at,
            gate_warmup=self.gate_warmup,
            loss_warmup=self.loss_warmup,
            unit=self.schedule_unit,
            temperature_start=self.temperature_start,
            temperature_end=self.temperature_end,
            score_weight_start=self.score_weight_start,
            score_weight_end=self.score_weight_end,
            rank_weight_start=self.rank_weight_start,
            rank_weight_end=self.rank_weight_end,
        )


@register
class DualPath(CosineRecipe):
    name = "dualpath"
    Config = DualPathConfig
    temperature_knob = "temperature_start"
    requires = frozenset({"text_pairs"})
    #: True once Phase 2 has copied the text path (a buffer, registered in ``__init__``)
    switched: Tensor
    #: runs saved before head_init existed started at PyTorch's init
    saved_config_defaults = {"head_init": "paper"}
    #: viPolyQwen Sec. 5.2: projection-layer lr 1.2e-4, clipping "adaptive from 100 to 10" (the
    #: project clips at the final 10.0); weight decay and warm-up are not stated (project: 0.2, 5%)
    train_defaults = {
        "lr": 1.2e-4,
        "weight_decay": 0.2,
        "warmup": 0.05,
        "min_lr_ratio": 0.0,
        "grad_clip": 10.0,
    }

    def __init__(self, config: DualPathConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        cfg = config
        self.curriculum = cfg.curriculum
        # texts only: a store holds token features for texts, images are pooled vectors
        self.text_pool: AttentionPooling | None = (
            AttentionPooling(text_dim, cfg.pool_queries) if cfg.pool_tokens else None
        )
        dims = {
            "image": image_dim,
            "text": self.text_pool.out_dim if self.text_pool is not None else text_dim,
        }
        self.head = DualPathHead(
            dims,
            cfg.model_dim,
            cfg.hidden_dim,
            cfg.embed_dim,
            dropout=cfg.dropout,
            gate_init=cfg.gate_init,
            residual_init=cfg.residual_init,
            tasks=TASKS if cfg.task_prefix else (),
            gate_speed=cfg.gate_speed,
        )
        # 1 once the multimodal path has been copied from the text path (survives checkpoints)
        self.register_buffer("switched", torch.zeros((), dtype=torch.bool))

    @classmethod
    def reads_text_tokens(cls, config: DualPathConfig) -> bool:
        return bool(config.pool_tokens)

    @classmethod
    def uses_alignment(cls, config: DualPathConfig) -> bool:
        """head_init=align on pooled features: token inputs are not what the alignment maps."""
        return config.head_init == "align" and not config.pool_tokens

    def warm_start(self, alignment: LinearAlignment) -> str:
        """The embedding starts on the residual branch at the alignment, both paths at zero.

        Adapters ``A_m`` at ``alignment.projections(model_dim)`` (biases and task prefixes
        zero), ``W_r`` [embed_dim, model_dim] the least-squares map taking the text adapter's
        columns to ``alignment.projections(embed_dim)``'s (``pinv(A_text) T_text``: exact where
        ``model_dim`` >= the text width, then ``W_r A_img`` is proportional to
        ``T_img`` too), and the output layers ``W_2^text``, ``W_2^multi`` and their biases at
        zero. Then ``z = 0`` for every input whatever the gate and the task, and
        ``e = (1 - a) W_r A_m x``: the step-0 cosine is the alignment's (reduced to its
        ``min(model_dim, embed_dim)`` leading directions where those are narrower than the
        text width), for image-caption pairs and, by the same isometry, the frozen text
        features' own cosine for text pairs.

        Why the output layers and not ``a = 0``: with ``a = 0`` the paths get no gradient
        until the scalar ``a`` has moved, about one learning rate a step under Adam (thousands
        of steps to reach the paper's 0.5); with zero output layers ``a`` keeps the paper's
        init, ``W_2`` takes its gradient at once and the shared expansion from the next step,
        and the start does not depend on the gate or on the Phase-2 copy of the text path
        into the multimodal path (both start at zero)."""
        cfg: DualPathConfig = self.config
        head = self.head
        adapt_img, adapt_txt = alignment.projections(cfg.model_dim)  # [D, model_dim]
        _, target_txt = alignment.projections(cfg.embed_dim)  # [Dt, embed_dim]
        residual = torch.linalg.pinv(adapt_txt.double()) @ target_txt.double()  # [m, e]
        with torch.no_grad():
            for modality, proj in (("image", adapt_img), ("text", adapt_txt)):
                adapter = head.adapter(modality)
                if adapter.in_features != proj.shape[0]:
                    raise ValueError(
                        f"dualpath: the warm start was fit on {proj.shape[0]}-d {modality} "
                        f"features, the adapter takes {adapter.in_features}-d"
                    )
                adapter.weight.copy_(proj.T)
                adapter.bias.zero_()
            if head.task_prefix is not None:
                head.task_prefix.zero_()
            head.residual.weight.copy_(residual.T.float())
            for layer in (head.text_path, head.multi_path):
                layer.weight.zero_()
                layer.bias.zero_()
        exact = min(cfg.model_dim, cfg.embed_dim) >= alignment.text_dim
        how = (
            "exactly" if exact else f"on its {min(cfg.model_dim, cfg.embed_dim)} leading directions"
        )
        return (
            f"residual branch at the alignment ({how}), both paths at zero, a "
            f"{float(head.mix.detach()):.2g}; " + start_agreement(self, alignment)
        )

    # --- embeddings ---------------------------------------------------------------------------
    def _inputs(
        self,
        features: Tensor,
        mask: Tensor | None,
        pool: AttentionPooling | None,
        dim: int,
        what: str,
    ) -> Tensor:
        if pool is not None:
            if features.ndim != 3 or features.shape[-1] != dim:
                raise ValueError(
                    f"dualpath (pool_tokens=True): {what} features must be tokens "
                    f"[N, L, {dim}], got {tuple(features.shape)}"
                )
            return pool(features, mask)
        if features.ndim != 2 or features.shape[-1] != dim:
            hint = " (token sequences need pool_tokens=true)" if features.ndim == 3 else ""
            raise ValueError(
                f"dualpath: {what} features must have shape [N, {dim}], got "
                f"{tuple(features.shape)}{hint}"
            )
        return features

    def logit_temperature(self, progress: Progress) -> float:
        """Sec. 4.4's temperature curriculum at ``progress``."""
        return dualpath_loss_weights(progress.step, progress.total, self.curriculum).temperature

    def embed_images(self, features: Tensor) -> Embedding:
        x = self._inputs(features, None, None, self.image_dim, "image")
        return {"point": sphere.project(self.head(x, "image", "image_text"), 1.0)}

    def embed_texts(
        self, features: Tensor, mask: Tensor | None = None, task: str = "image_text"
    ) -> Embedding:
        """Texts for image retrieval (``task="image_text"``) or text similarity (``"text_pair"``)."""
        if task not in TASKS:
            raise ValueError(f"dualpath: task must be one of {list(TASKS)}, got {task!r}")
        x = self._inputs(features, mask, self.text_pool, self.text_dim, "text")
        return {"point": sphere.project(self.head(x, "text", task), 1.0)}

    def embed_text_pairs(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        """Texts for text-text similarity: the "text_pair" prefix Phase 1 trained."""
        return self.embed_texts(features, mask, task="text_pair")

    # --- curriculum ---------------------------------------------------------------------------
    def on_step_start(self, progress: Progress) -> None:
        """Path copy at the first Phase-2 step (once), gate warm-up factor for this step."""
        if dualpath_phase(progress.step, progress.total, self.curriculum) == 2 and not bool(
            self.switched
        ):
            self.head.copy_text_to_multimodal()
            self.switched.fill_(True)
        self.head.gate_warmup.fill_(
            dualpath_gate_warmup(progress.step, progress.total, self.curriculum)
        )

    # --- training -----------------------------------------------------------------------------
    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        cfg: DualPathConfig = self.config
        self.on_step_start(progress)  # idempotent: a loop that forgets the hook still copies once
        phase = dualpath_phase(progress.step, progress.total, self.curriculum)
        weights = dualpath_loss_weights(progress.step, progress.total, self.curriculum)
        tau = weights.temperature

        if batch.pair_a is None or batch.pair_b is None or batch.pair_score is None:
            raise ValueError(
                "dualpath trains on scored text pairs: the batch needs pair_a, pair_b and "
                "pair_score (a feature store with text pairs)"
            )
        if not (batch.pair_a.shape[0] == batch.pair_b.shape[0] == batch.pair_score.shape[0]):
            raise ValueError(
                f"dualpath: pair_a, pair_b, pair_score have {batch.pair_a.shape[0]}, "
                f"{batch.pair_b.shape[0]}, {batch.pair_score.shape[0]} rows; they must match"
            )
        local_a = self.embed_texts(batch.pair_a, batch.pair_a_mask, task="text_pair")
        local_b = self.embed_texts(batch.pair_b, batch.pair_b_mask, task="text_pair")
        all_a, all_b = gather(local_a), gather(local_b)
        pair_offset = gather.offset(batch.pair_a.shape[0])
        s = batch.pair_score
        # ratios and pairwise terms over the global pair batch (see losses.multiloss)
        s_mean = gather.average(s.float().mean())
        text_nce = 0.5 * (
            score_weighted_info_nce(
                cosine_scores(local_a["point"], all_b["point"]), s, tau, pair_offset, s_mean
            )
            + score_weighted_info_nce(
                cosine_scores(local_b["point"], all_a["point"]), s, tau, pair_offset, s_mean
            )
        )
        pair_cos = cosine_pair_scores(local_a["point"], local_b["point"])
        mse = score_mse(pair_cos, s)
        everyone = gather({"cos": pair_cos, "score": s})
        rank = pair_ranking(pair_cos, s, everyone["cos"], everyone["score"], gather.world_size)
        terms = {
            "text_info_nce": text_nce,
            "score_mse": weights.score_weight * mse,
            "rank": weights.rank_weight * rank,
        }
        logs = {
            "text_info_nce": float(text_nce.detach()),
            "score_mse_unweighted": float(mse.detach()),
            "rank_unweighted": float(rank.detach()),
        }

        if phase == 2 and not cfg.phase2_text_pairs:
            terms = {}  # the ablation: Phase 2 on image-caption pairs only (text parts still logged)

        if phase == 2:
            if batch.image.shape[0] != batch.text.shape[0]:
                raise ValueError(
                    f"dualpath: batch has {batch.image.shape[0]} images but "
                    f"{batch.text.shape[0]} texts; rows must be matched pairs"
                )
            images = self.embed_images(batch.image)
            texts = self.embed_texts(batch.text, batch.text_mask)
            all_images, all_texts = gather(images), gather(texts)
            offset = gather.offset(batch.image.shape[0])
            i2t = cosine_scores(images["point"], all_texts["point"])
            t2i = cosine_scores(texts["point"], all_images["point"])
            visual_nce = symmetric_info_nce(i2t, t2i, temperature=tau, offset=offset)
            triplet = 0.5 * (
                hardest_negative_triplet(i2t, cfg.triplet_margin, offset)
                + hardest_negative_triplet(t2i, cfg.triplet_margin, offset)
            )
            terms["image_info_nce"] = visual_nce
            terms["triplet"] = cfg.triplet_weight * triplet
            logs.update(
                {
                    "image_info_nce": float(visual_nce.detach()),
                    "triplet_unweighted": float(triplet.detach()),
                }
            )

        total = sum_terms(terms)
        logs.update(
            {
                "dualpath_phase": float(phase),
                "temperature": tau,
                "score_weight": weights.score_weight,
                "rank_weight": weights.rank_weight,
                **self.log_values(),
            }
        )
        return LossOutput(total=total, terms=terms, logs=logs)

    def no_decay_parameter_names(self) -> set[str]:
        # task prefixes are embeddings: decay would pull them to "no prefix"
        extra = {"head.task_prefix"} if self.head.task_prefix is not None else set()
        return super().no_decay_parameter_names() | extra

    def gate_value(self) -> float:
        with torch.no_grad():
            return float(self.head.gate())

    def log_values(self) -> dict[str, float]:
        with torch.no_grad():
            return {
                "dualpath_gate": self.gate_value(),
                "gate_warmup": float(self.head.gate_warmup),
                "residual_mix": float(self.head.mix),
            }

    @classmethod
    def search_space(cls) -> dict:
        """Shared nuisance knobs, the first and final temperature of the curriculum (the step-0
        check names the first: ``temperature_knob``), and the phase lengths
        (fractions of the run: the paper's are set for 7.5M samples): when the multimodal path
        starts, how long its gate warms up, how long the loss weights ramp."""
        from curvalign.recipes.base import Knob, shared_search_space

        return {
            **shared_search_space(cls),
            "temperature_start": Knob("float", 0.03, 0.3, log=True, why="paper 0.1, about 3x"),
            "temperature_end": Knob("float", 0.02, 0.2, log=True, why="paper 0.07, about 3x"),
            "switch_at": Knob("float", 0.05, 0.6, role="method", why="phase 2 start; paper 0.13"),
            "gate_warmup": Knob("float", 0.01, 0.2, role="method", why="gate warm-up; paper 0.07"),
            "loss_warmup": Knob("float", 0.05, 0.5, role="method", why="loss ramp; paper 0.13"),
        }

    def phase_steps(self, total: int) -> tuple[int, ...]:
        """Phase 2's first step, the end of its gate warm-up and the end of the loss ramp."""
        import math

        from curvalign.schedules import dualpath_switch_step

        cur = self.curriculum
        switch = dualpath_switch_step(total, cur)
        ends = (switch + cur.steps("gate_warmup", total), cur.steps("loss_warmup", total))
        return tuple(sorted({switch, *(math.ceil(e) for e in ends)}))


__all__ = ["DualPath", "DualPathConfig"]
