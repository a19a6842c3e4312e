"""The linear alignment every head starts from (docs/methods.md, "The warm start").

A head trained on frozen features should be judged by what its geometry adds to the best linear
alignment of the two sides, not by how far its optimiser got from a random projection. The
alignment is computed once, in closed form, from the train pairs, and each recipe says how its
heads start from it (``Recipe.warm_start``).

Candidates  "identity"  the two sides share a space (same width): texts and images as they are;
            "ridge"     images mapped into the text space, ``W = argmin |X W - T|^2 + lam |W|^2``
                        over the train captions (X: each caption's image row), no intercept (the
                        heads have no bias, so the start is exactly what a bias-free head can
                        hold), ``lam = alpha * trace(X^T X) / D_img`` with ``alpha`` in ``ALPHAS``.
Choice      the candidate with the best mean of T2I and I2T R@1 on the "val" split, ranked by
            cosine of the mapped features (never on test).
Heads       ``LinearAlignment.projections(width)``: ``A_img = W P``, ``A_txt = P`` with ``P``
            [D_text, width] an orthonormal basis of the text space ordered by the train
            embeddings' second moment (its first ``width`` columns where the head is narrower;
            an isometric embedding where it is wider), each map scaled so that the mapped train
            features keep their mean norm (gain 1, so the data-aware head scales apply as for
            the input-preserving start). Cosine of ``x A_img`` and ``t A_txt`` then equals the
            alignment's cosine exactly when ``width >= D_text``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from curvalign.errors import InputError

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore

#: relative ridge strengths tried on validation (scale-free: times the mean feature variance)
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
#: ridge strength used where there is no validation split to choose one on
DEFAULT_ALPHA = 1e-2
#: train pairs the closed form reads at most (runs of consecutive rows, evenly spread): the Gram matrices of
#: 50 000 rows fix a map of a few hundred columns well, and the fit stays seconds at 10M pairs
MAX_FIT_PAIRS = 50_000
#: validation images scored at most when choosing the candidate
MAX_VAL_IMAGES = 5_000
#: consecutive rows per run when a split is sampled down to a cap (64 rows of 512-d float16
#: are 16 pages of 4 KiB; a row drawn alone from a shard costs a page, 4x its bytes)
SAMPLE_RUN_ROWS = 64

AlignmentKind = Literal["identity", "ridge"]


@dataclass(frozen=True)
class LinearAlignment:
    """The closed-form alignment of a store's two sides, fit on train, chosen on validation.

    image_map     [D_img, D_text] float64: images into the text space (the identity for
                  ``kind == "identity"``)
    basis         [D_text, D_text] float64 orthonormal columns, ordered by decreasing second
                  moment of the mapped train embeddings (both sides)
    kind          "identity" or "ridge"
    alpha         the relative ridge strength (None for the identity)
    val_r1        mean of T2I and I2T R@1 (%) of the cosine ranking on the validation split
                  (None without one)
    image_norm, text_norm   mean input norm of the train rows of each side
    image_rows    train captions the fit read
    """

    image_map: Tensor
    basis: Tensor
    kind: AlignmentKind
    alpha: float | None
    val_r1: float | None
    image_norm: float
    text_norm: float
    image_rows: int
    _image_sample: Tensor
    _text_sample: Tensor

    @property
    def image_dim(self) -> int:
        return int(self.image_map.shape[0])

    @property
    def text_dim(self) -> int:
        return int(self.image_map.shape[1])

    def projections(self, width: int) -> tuple[Tensor, Tensor]:
        """(A_img [D_img, width], A_txt [D_text, width]) float32: the alignment reduced to (or
        embedded in) ``width`` columns, each scaled to keep its side's mean train norm. Wider
        than the text space, the extra columns come from a random rotation drawn from the global
        RNG (seed it first), so that every output coordinate carries signal."""
        if width <= 0:
            raise ValueError(f"the head width must be positive, got {width}")
        dt = self.text_dim
        if width <= dt:
            basis = self.basis[:, :width]
        else:
            q, _ = torch.linalg.qr(torch.randn(width, width, dtype=torch.float64))
            basis = self.basis @ q[:dt]  # [Dt, width], orthonormal rows: an isometry
        image_proj = self.image_map @ basis
        text_proj = basis.clone()
        image_proj = image_proj * _norm_ratio(self._image_sample, image_proj, self.image_norm)
        text_proj = text_proj * _norm_ratio(self._text_sample, text_proj, self.text_norm)
        return image_proj.float(), text_proj.float()

    def train_pairs(self, max_texts: int = 1024) -> tuple[Tensor, Tensor, Tensor]:
        """(images [Ni, D_img], texts [Nt, D_text], owner [Nt]) float64: up to ``max_texts``
        of the train captions the fit read (the first ones of its strided sample) with their
        distinct images, ``owner`` the local image of each caption. What a recipe's
        ``warm_start`` measures its start against (``mean_r1``), never validation rows."""
        rows = slice(0, min(max_texts, len(self._text_sample)))
        images, owner = torch.unique(self._image_sample[rows], dim=0, return_inverse=True)
        return images, self._text_sample[rows], owner

    def describe(self) -> str:
        """One line: which candidate, its strength and validation score."""
        what = (
            "identity (the two sides in one space)"
            if self.kind == "identity"
            else (f"ridge image->text, alpha {self.alpha:g}")
        )
        score = "no validation split" if self.val_r1 is None else f"val mean R@1 {self.val_r1:.1f}"
        return f"warm start: {what}, {score}, fit on {self.image_rows} train captions"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "alpha": self.alpha,
            "val_r1": None if self.val_r1 is None else round(self.val_r1, 4),
            "image_dim": self.image_dim,
            "text_dim": self.text_dim,
            "train_captions": self.image_rows,
        }


def _norm_ratio(sample: Tensor, proj: Tensor, target: float) -> float:
    mapped = float(torch.linalg.vector_norm(sample @ proj, dim=-1).mean())
    return target / mapped if mapped > 0 else 1.0


def solve_ridge(x: Tensor, y: Tensor, alpha: float, intercept: bool) -> tuple[Tensor, Tensor]:
    """(W [Dx, Dy], b [Dy]) of ridge regression ``y ~ x W + b`` in float64, strength
    ``lam = alpha * trace(Xc^T Xc) / Dx`` (scale-free); ``intercept=False`` fits ``y ~ x W``
    (b = 0) on uncentred rows. x: [N, Dx], y: [N, Dy]."""
    x, y = x.double(), y.double()
    if intercept:
        mean_x, mean_y = x.mean(0), y.mean(0)
        x, y = x - mean_x, y - mean_y
    gram = x.T @ x
    lam = alpha * float(torch.trace(gram)) / gram.shape[0]
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    weight = torch.linalg.solve(gram + max(lam, 1e-12) * eye, x.T @ y)
    bias = (mean_y - mean_x @ weight) if intercept else torch.zeros(y.shape[1], dtype=y.dtype)
    return weight, bias


def spread_runs(ids: Tensor, max_rows: int) -> Tensor:
    """At most ``max_rows`` of ``ids`` ``[N]`` (all of them when there are no more): runs of
    ``SAMPLE_RUN_ROWS`` consecutive entries at evenly spaced starts, in order. The warm start's
    fit and the check for held-out images copied from train take the same train rows, so a
    memory-mapped store reads their pages once."""
    if len(ids) <= max_rows:
        return ids
    run = min(SAMPLE_RUN_ROWS, max_rows)
    starts = torch.linspace(0, len(ids) - run, -(-max_rows // run)).round().long()
    return ids[(starts[:, None] + torch.arange(run)).flatten().unique()[:max_rows]]


def split_pairs(store: FeatureStore, split: str, max_rows: int | None = None) -> tuple[Tensor, ...]:
    """(image features [Ni, Di], text features [Nt, Dt], text_to_image [Nt] local ids, caption
    image rows [Nt, Di]) of ``split``, float64; ``max_rows`` caps the images: runs of
    ``SAMPLE_RUN_ROWS`` consecutive ids at evenly spaced starts (a memory-mapped shard then
    reads whole pages of wanted rows, not one page per row)."""
    image_ids = store.split_image_ids(split)
    if max_rows is not None:
        image_ids = spread_runs(image_ids, max_rows)
    local = torch.full((store.num_images,), -1, dtype=torch.long)
    local[image_ids] = torch.arange(len(image_ids))
    owner = local[torch.as_tensor(store.text_to_image).long()]
    text_ids = torch.nonzero(owner >= 0).flatten()
    images = torch.as_tensor(store.image_features[image_ids]).double()
    texts = torch.as_tensor(store.text_features[text_ids]).double()
    return images, texts, owner[text_ids], images[owner[text_ids]]


def _unit(x: Tensor) -> Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)


def cosine_mean_r1(images: Tensor, texts: Tensor, owner: Tensor) -> float:
    """Mean of T2I and I2T R@1 (%) of the cosine ranking: images [Ni, D], texts [Nt, D],
    owner [Nt] the image of each text (``mean_r1`` of the cosine matrix)."""
    return mean_r1(_unit(texts.float()) @ _unit(images.float()).T, owner)


def mean_r1(scores: Tensor, owner: Tensor, image_scores: Tensor | None = None) -> float:
    """Mean of T2I and I2T R@1 (%) of a score matrix [Nt, Ni] (higher = closer), ``owner``
    [Nt] the image of each text; ``image_scores`` [Nt, Ni] the matrix ranked for image queries
    where it differs (a recipe whose score depends on the query side), default ``scores``. An
    image counts as found (I2T) when its top text is one of its captions; ties go to the lower
    index, as ``eval.retrieval`` breaks them."""
    image_scores = scores if image_scores is None else image_scores
    n_images = scores.shape[1]
    t2i = (scores.argmax(dim=1) == owner).float().mean()
    has_caption = torch.zeros(n_images, dtype=torch.bool)
    has_caption[owner] = True
    i2t = (owner[image_scores.argmax(dim=0)] == torch.arange(n_images))[has_caption]
    return float(50.0 * (t2i + i2t.float().mean()))


def _second_moment_basis(*parts: Tensor) -> Tensor:
    """Orthonormal eigenvectors [D, D] of the summed uncentred second moments of ``parts``
    (each [N, D]), by decreasing eigenvalue: the directions cosine relies on most."""
    moment = sum(p.T @ p / max(1, p.shape[0]) for p in parts)
    values, vectors = torch.linalg.eigh(moment)
    return vectors[:, torch.argsort(values, descending=True)]


def fit_alignment(
    store: FeatureStore, train_split: str = "train", val_split: str | None = "val"
) -> LinearAlignment:
    """The ``LinearAlignment`` of ``store``: candidates fit on ``train_split``, the best on
    ``val_split`` (None, or a store without it: the identity where the widths agree, else ridge
    at ``DEFAULT_ALPHA``). Raises ``InputError`` when the train split has fewer than 2 captions."""
    _, texts, _, x = split_pairs(store, train_split, max_rows=MAX_FIT_PAIRS)
    if len(texts) < 2:
        raise InputError(f"the warm start needs captions in the {train_split!r} split")
    same_width = x.shape[1] == texts.shape[1]
    candidates: list[tuple[AlignmentKind, float | None, Tensor]] = []
    if same_width:
        candidates.append(("identity", None, torch.eye(x.shape[1], dtype=torch.float64)))
    for strength in ALPHAS:
        candidates.append(("ridge", strength, solve_ridge(x, texts, strength, intercept=False)[0]))
    has_val = val_split is not None and val_split in (store.split_names or [])
    val = (
        split_pairs(store, val_split, max_rows=MAX_VAL_IMAGES)
        if has_val and val_split is not None
        else None
    )
    if val is None or len(val[1]) == 0:
        kind, alpha, image_map = next(
            c for c in candidates if c[0] == "identity" or c[1] == DEFAULT_ALPHA
        )
        val_r1 = None
    else:
        val_images, val_texts, val_owner, _ = val
        scored = [
            (cosine_mean_r1(val_images @ m, val_texts, val_owner), -i, (k, a, m))
            for i, (k, a, m) in enumerate(candidates)
        ]
        val_r1, _, (kind, alpha, image_map) = max(scored, key=lambda s: (s[0], s[1]))
    images = x @ image_map
    sample = slice(0, min(len(texts), 20_000))
    return LinearAlignment(
        image_map=image_map,
        basis=_second_moment_basis(images, texts),
        kind=kind,
        alpha=alpha,
        val_r1=val_r1,
        image_norm=float(torch.linalg.vector_norm(x, dim=-1).mean()),
        text_norm=float(torch.linalg.vector_norm(texts, dim=-1).mean()),
        image_rows=len(texts),
        _image_sample=x[sample],
        _text_sample=texts[sample],
    )


__all__ = [
    "ALPHAS",
    "DEFAULT_ALPHA",
    "LinearAlignment",
    "MAX_FIT_PAIRS",
    "SAMPLE_RUN_ROWS",
    "cosine_mean_r1",
    "fit_alignment",
    "mean_r1",
    "solve_ridge",
    "split_pairs",
    "spread_runs",
]
