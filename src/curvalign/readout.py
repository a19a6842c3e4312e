"""Reading a feature store through a recipe: what ``train/``, ``eval/`` and ``index/`` share.

``train | index | eval`` may not import each other, so what more than one of them needs lives
here, once, one floor below them (and above ``runs``):

- **embedding a store part** (images, box crops, or a text part: pooled features ``[n, D]``, or
  token features ``[n, L, Dk]`` with their mask when the recipe reads text tokens), batch by
  batch, each batch cast to float32 on the recipe's device whatever the store holds (float16
  and memory-mapped stores are read one batch at a time, never converted whole);
- **the input-width check** of a recipe against a store, with a message naming the cause
  (another encoder, or a recipe built for pooled text features that reads tokens, or the
  reverse);
- **scores in tiles** of at most ``PAIR_BUDGET`` pairs per ``recipe.scores`` call: the dense
  ``[Nt, Ni]`` matrix for callers that need it (small splits), and the **retrieval ranks of the
  true match** for any split size without a dense matrix (a count of the candidates scoring at
  least as high, tile by tile);
- **the rank definition behind recall@k** (ties pessimistic: a wrong candidate scoring equal to
  the right one ranks above it, so a constant score matrix gives recall@1 = 0), and recall from
  ranks. ``eval.retrieval.recall_at_k`` and training's validation metric both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from curvalign.data.features import TEXT_PARTS, FeatureStore
from curvalign.errors import CurvalignError, InputError
from curvalign.recipes.base import Embedding, Query, Recipe, embedding_size, slice_embedding

#: pairs scored per ``recipe.scores`` call (bounds the memory of per-pair routers such as AGR's,
#: and of every score tile: no call, and no comparison, holds more than this many pairs)
PAIR_BUDGET = 1 << 20

#: store parts held as pooled features only: part -> (FeatureStore field, modality)
POOLED_PARTS = {
    "image": ("image_features", "image"),
    "box_image": ("box_image_features", "image"),
    "box_text": ("box_text_features", "text"),
}

#: (text ids [r] (long), image columns) -> scores [r, c] float32 on the CPU, higher is better
ScoreTile = Callable[[Tensor, slice], Tensor]


class MemoryBudgetError(CurvalignError, MemoryError):
    """Something asked for more memory than the machine has; the message says what and why."""


# --- embedding ----------------------------------------------------------------------------------


def recipe_device(recipe: Recipe) -> torch.device:
    """The device of the recipe's parameters (CPU for a recipe without parameters)."""
    return next((p.device for p in recipe.parameters()), torch.device("cpu"))


@torch.no_grad()
def embed_rows(
    recipe: Recipe,
    modality: str,
    features: Tensor | np.ndarray,
    mask: Tensor | np.ndarray | None = None,
    device: torch.device | str | None = None,
) -> Embedding:
    """One batch through the recipe: ``features`` [n, D] pooled (``modality`` "image" or
    "text"), or text token features [n, L, Dk] with ``mask`` [n, L] (a tensor or an array,
    memory-mapped or not). Cast to float32 and moved to ``device`` (default: the recipe's)."""
    device = recipe_device(recipe) if device is None else torch.device(device)
    x = features if isinstance(features, Tensor) else torch.as_tensor(np.asarray(features))
    x = x.to(device=device, dtype=torch.float32)
    if modality == "image":
        return recipe.embed_images(x)
    if mask is None:
        return recipe.embed_texts(x)
    m = mask if isinstance(mask, Tensor) else torch.as_tensor(np.asarray(mask))
    return recipe.embed_texts(x, m.to(device=device, dtype=torch.long))


def embed_store_rows(
    recipe: Recipe,
    store: FeatureStore,
    part: str,
    rows: Tensor | slice,
    device: torch.device | str | None = None,
) -> Embedding:
    """Rows ``rows`` of one store part as the recipe reads it (one batch).

    ``part``: "image", "box_image", "box_text" (pooled only) or a text part of ``TEXT_PARTS``
    ("text", "prompt", "negative", "pair_a", "pair_b"): pooled features, or token features and
    their masks when ``recipe.text_tokens`` (cut to the longest sequence among these rows).
    """
    if part in TEXT_PARTS:
        if recipe.text_tokens:
            tokens, mask = store.text_rows(part, rows, tokens=True)
            return embed_rows(recipe, "text", tokens, mask, device)
        return embed_rows(recipe, "text", store.text_rows(part, rows)[0], device=device)
    if part not in POOLED_PARTS:
        raise InputError(
            f"unknown store part {part!r}; expected one of "
            f"{', '.join([*POOLED_PARTS, *TEXT_PARTS])}"
        )
    field, modality = POOLED_PARTS[part]
    values = store.field(field)
    if values is None:
        raise InputError(f"the feature store has no {part} features ({field} is absent)")
    if modality == "text" and recipe.text_tokens:
        raise InputError(f"{recipe.name} reads text tokens and {part} texts have no token features")
    return embed_rows(recipe, modality, values[rows], device=device)


def _batches(count: int, batch_size: int) -> Iterator[slice]:
    if batch_size < 1:
        raise InputError(f"batch_size must be positive, got {batch_size}")
    return (slice(i, min(count, i + batch_size)) for i in range(0, count, batch_size))


def _concat(parts: list[Embedding], what: str) -> Embedding:
    if not parts:
        raise InputError(f"no {what} to embed")
    try:
        return {k: torch.cat([p[k] for p in parts], dim=0) for k in parts[0]}
    except (RuntimeError, MemoryError) as err:
        raise _memory_error(err, f"the embeddings of the {what} (use a smaller split)") from None


@torch.no_grad()
def embed_store_part(
    recipe: Recipe,
    store: FeatureStore,
    part: str,
    ids: Tensor | None = None,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
) -> Embedding:
    """Rows ``ids`` (default: every row) of one store part (see ``embed_store_rows``),
    embedded ``batch_size`` rows at a time; n items on the recipe's device."""
    if ids is None:
        field = POOLED_PARTS[part][0] if part in POOLED_PARTS else TEXT_PARTS[part][0]
        values = store.field(field)
        count = 0 if values is None else int(values.shape[0])
        ids = torch.arange(count)
    parts = [
        embed_store_rows(recipe, store, part, ids[batch], device)
        for batch in _batches(len(ids), batch_size)
    ]
    return _concat(parts, f"{part} rows")


@torch.no_grad()
def embed_features(
    recipe: Recipe,
    features: Tensor | np.ndarray,
    modality: str,
    batch_size: int = 1024,
    mask: Tensor | np.ndarray | None = None,
    device: torch.device | str | None = None,
) -> Embedding:
    """Feature rows ``features`` [N, D] (or text tokens [N, L, Dk] with ``mask`` [N, L]) of
    ``modality`` embedded ``batch_size`` rows at a time; N items."""
    parts = [
        embed_rows(recipe, modality, features[b], None if mask is None else mask[b], device=device)
        for b in _batches(int(features.shape[0]), batch_size)
    ]
    return _concat(parts, f"{modality} features")


# --- input widths -------------------------------------------------------------------------------


def input_width_problem(recipe: Recipe, store: FeatureStore) -> str | None:
    """Why ``store``'s features do not fit ``recipe``'s input widths, or None when they do.

    The widths a store offers: pooled image ``Di``, pooled text ``Dt``, and (with tokens) the
    token width ``Dk``; a recipe that reads text tokens takes ``Dk`` as its text width
    (``runs.recipe_input_dims``). A store without tokens for such a recipe raises
    ``FeatureStoreError`` (its own clear message).
    """
    di, dt = store.input_dims(text_tokens=recipe.text_tokens)
    problems = []
    if di != recipe.image_dim:
        problems.append(
            f"the store's image features are {di}-wide but {recipe.name} takes "
            f"{recipe.image_dim}: they come from another image encoder than the run's"
        )
    if dt != recipe.text_dim:
        pooled, tokens = store.text_dim, store.token_dim
        if recipe.text_tokens and pooled == recipe.text_dim:
            problems.append(
                f"{recipe.name} reads text tokens, which are {dt}-wide in this store, but it was "
                f"built for the {pooled}-wide pooled text features (a recipe that reads tokens "
                "takes the token width: build it with runs.recipe_input_dims)"
            )
        elif not recipe.text_tokens and tokens is not None and tokens == recipe.text_dim:
            problems.append(
                f"{recipe.name} reads pooled text features, which are {dt}-wide in this store, "
                f"but it was built for the {tokens}-wide text tokens (configured to read pooled "
                "features where its run read tokens?)"
            )
        else:
            kind = "text tokens" if recipe.text_tokens else "text features"
            problems.append(
                f"the store's {kind} are {dt}-wide but {recipe.name} takes {recipe.text_dim}: "
                "they come from another text encoder than the run's"
            )
    return "; ".join(problems) or None


def check_input_widths(recipe: Recipe, store: FeatureStore) -> None:
    """One ``InputError`` naming the cause when ``store`` does not fit ``recipe``'s inputs."""
    problem = input_width_problem(recipe, store)
    if problem is not None:
        raise InputError(problem)


# --- scores in tiles ----------------------------------------------------------------------------


def _memory_error(err: BaseException, what: str) -> BaseException:
    """``err`` as a MemoryBudgetError naming ``what`` when it is an allocation failure; else
    ``err`` itself (a bug shows its own traceback)."""
    text = str(err).lower()
    if isinstance(err, MemoryError) or "alloc" in text or "out of memory" in text:
        first = str(err).splitlines()[0] if str(err) else repr(err)
        return MemoryBudgetError(f"{what}: more than this machine's memory holds ({first})")
    return err


def recipe_score_tile(
    recipe: Recipe, texts: Embedding, images: Embedding, query: Query
) -> ScoreTile:
    """The ``ScoreTile`` of ``recipe.scores(texts, images, query=query)``: rows ``text_ids``,
    columns ``image_cols``, float32 on the CPU."""

    def tile(text_ids: Tensor, image_cols: slice) -> Tensor:
        part = slice_embedding(texts, text_ids.to(next(iter(texts.values())).device))
        return recipe.scores(part, slice_embedding(images, image_cols), query=query).float().cpu()

    return tile


@torch.no_grad()
def score_matrix(
    recipe: Recipe, texts: Embedding, images: Embedding, query: Query = "text"
) -> Tensor:
    """[Nt, Ni] ``recipe.scores`` computed over row chunks of texts (at most ``PAIR_BUDGET`` pairs
    per call), float32 on the CPU. Dense: for splits whose matrix fits in memory; retrieval
    ranks at any size come from ``retrieval_ranks`` instead. A matrix that cannot be allocated
    is a ``MemoryBudgetError`` naming its size."""
    n_text, n_image = embedding_size(texts), embedding_size(images)
    rows = max(1, PAIR_BUDGET // max(1, n_image))
    try:
        out = torch.empty(n_text, n_image, dtype=torch.float32)
    except (RuntimeError, MemoryError) as err:
        gb = 4 * n_text * n_image / 2**30
        raise _memory_error(
            err,
            f"the dense {n_text} x {n_image} score matrix ({gb:.1f} GiB float32; retrieval "
            "ranks need none: readout.retrieval_ranks)",
        ) from None
    for start in range(0, n_text, rows):
        out[start : start + rows] = (
            recipe.scores(slice_embedding(texts, slice(start, start + rows)), images, query=query)
            .float()
            .cpu()
        )
    return out


def _finite(tile: Tensor, name: str | None) -> Tensor:
    """``tile``, or an InputError naming ``name`` when it holds NaN or inf (None: checked
    already). One reduction pass (amin/amax propagate NaN), cheaper than isfinite().all()."""
    if name is None or not tile.numel():
        return tile
    low, high = torch.aminmax(tile)
    if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
        raise InputError(
            f"{name} contains NaN or infinite values; the model's scores are not usable"
        )
    return tile


def _spans(begin: int, end: int, width: int) -> Iterator[tuple[int, int]]:
    return ((s, min(end, s + width)) for s in range(begin, end, width))


def text_to_image_ranks_tiled(
    tile: ScoreTile,
    n_text: int,
    n_image: int,
    text_to_image: Tensor,
    budget: int | None = None,
    name: str | None = "scores",
) -> Tensor:
    """[n_text] rank of each caption's image among all ``n_image`` images (0 = first): the number
    of other images scoring at least as high (ties pessimistic), from tiles of at most
    ``budget`` pairs (default ``PAIR_BUDGET``), never the whole matrix.

    Captions are taken in image order, in chunks whose right images lie in one column window;
    that window is scored first, so each right score comes from the same kind of call as the
    candidates it is compared with (ties between identical items stay ties)."""
    budget = PAIR_BUDGET if budget is None else int(budget)
    t2i = text_to_image.long().cpu()
    ranks = torch.empty(n_text, dtype=torch.long)
    if n_text == 0:
        return ranks
    cols = min(n_image, budget)
    rows = max(1, budget // cols)
    order = torch.argsort(t2i, stable=True)
    image_of = t2i[order]
    start = 0
    while start < n_text:
        first = int(image_of[start])
        # captions whose image lies in [first, first + cols), at most `rows` of them
        end = min(start + rows, int(torch.searchsorted(image_of, torch.tensor(first + cols))))
        ids = order[start:end]
        lo = min(first, n_image - cols)
        window = _finite(tile(ids, slice(lo, lo + cols)), name)
        right = window.gather(1, (t2i[ids] - lo)[:, None])
        count = (window >= right).sum(1) - 1  # every image at least as high, less the right one
        for a, b in [*_spans(0, lo, cols), *_spans(lo + cols, n_image, cols)]:
            count += (_finite(tile(ids, slice(a, b)), name) >= right).sum(1)
        ranks[ids] = count
        start = end
    return ranks


def image_to_text_ranks_tiled(
    tile: ScoreTile,
    n_text: int,
    n_image: int,
    text_to_image: Tensor,
    budget: int | None = None,
    name: str | None = "i2t scores",
) -> Tensor:
    """[n_image] rank of the best of each image's captions among all ``n_text`` captions: the
    number of other images' captions scoring at least as high as it (ties pessimistic); -1 for
    an image without captions. ``tile`` gives scores with the image as the query; tiles of at
    most ``budget`` pairs (default ``PAIR_BUDGET``), never the whole matrix.

    Images are taken in chunks whose own captions (contiguous once captions are sorted by
    image) fit one row window; that window is scored first, giving each image's best own score.
    """
    budget = PAIR_BUDGET if budget is None else int(budget)
    t2i = text_to_image.long().cpu()
    ranks = torch.full((n_image,), -1, dtype=torch.long)
    if n_text == 0 or n_image == 0:
        return ranks
    rows = min(n_text, budget)
    cols = max(1, budget // rows)
    order = torch.argsort(t2i, stable=True)
    image_of = t2i[order]
    images = torch.arange(n_image)
    begin = torch.searchsorted(image_of, images)
    stop = torch.searchsorted(image_of, images, right=True)
    j = 0
    while j < n_image:
        k = int(torch.searchsorted(stop, begin[j] + rows, right=True))
        k = max(j + 1, min(k, j + cols, n_image))
        b, e = int(begin[j]), int(stop[k - 1])
        chunk = slice(j, k)
        if e - b <= rows:  # the chunk's own captions fit one window: score it first
            p = min(b, n_text - rows)
            window = _finite(tile(order[p : p + rows], chunk), name)
            own_cols = image_of[b:e] - j  # the own captions' columns, rows b - p .. e - p
            own = window[torch.arange(b - p, e - p), own_cols]
            best = torch.full((k - j,), float("-inf")).scatter_reduce(0, own_cols, own, "amax")
            count = (window >= best).sum(0)
            # less the own captions at least as high as the best one (itself and exact ties)
            count -= torch.zeros(k - j, dtype=torch.long).scatter_add(
                0, own_cols, (own >= best[own_cols]).long()
            )
            spans = [*_spans(0, p, rows), *_spans(p + rows, n_text, rows)]
        else:  # one image with more captions than a window holds: its best first, then count
            best = torch.full((1,), float("-inf"))
            for a, z in _spans(b, e, rows):
                best = torch.maximum(best, _finite(tile(order[a:z], chunk), name).max(0).values)
            count = torch.zeros(1, dtype=torch.long)
            spans = [*_spans(0, b, rows), *_spans(e, n_text, rows)]  # its own captions never count
        for a, z in spans:
            count += (_finite(tile(order[a:z], chunk), name) >= best).sum(0)
        ranks[chunk] = torch.where(stop[chunk] > begin[chunk], count, -1)
        j = k
    return ranks


def _check_matrix(scores: Tensor, text_to_image: Tensor, name: str) -> None:
    if scores.ndim != 2:
        raise InputError(
            f"{name} must be a [n_text, n_image] matrix, got shape {tuple(scores.shape)}"
        )
    if text_to_image.ndim != 1 or text_to_image.shape[0] != scores.shape[0]:
        raise InputError(
            f"text_to_image must have shape [{scores.shape[0]}] (one image per caption), "
            f"got {tuple(text_to_image.shape)}"
        )
    if scores.shape[0] and (
        int(text_to_image.min()) < 0 or int(text_to_image.max()) >= scores.shape[1]
    ):
        raise InputError(f"text_to_image holds image ids outside [0, {scores.shape[1]})")
    _finite(scores, name)  # once for the whole matrix: its tiles are not checked again


def _matrix_tile(scores: Tensor) -> ScoreTile:
    def tile(ids: Tensor, cols: slice) -> Tensor:
        first = int(ids[0]) if len(ids) else 0
        if len(ids) and int(ids[-1]) - first + 1 == len(ids) and bool((ids.diff() == 1).all()):
            return scores[first : first + len(ids), cols].float().cpu()  # a view, no copy
        return scores[ids.to(scores.device), cols].float().cpu()

    return tile


def text_to_image_ranks(scores: Tensor, text_to_image: Tensor) -> Tensor:
    """[n_text] rank of each caption's image among all images (0 = first), ties pessimistic.

    scores: [n_text, n_image], higher is better; text_to_image: [n_text].
    """
    _check_matrix(scores, text_to_image, "scores")
    n_text, n_image = scores.shape
    budget = max(PAIR_BUDGET, n_image)
    return text_to_image_ranks_tiled(
        _matrix_tile(scores), n_text, n_image, text_to_image, budget, None
    )


def image_to_text_ranks(scores: Tensor, text_to_image: Tensor) -> Tensor:
    """[n_image] rank of the best of each image's captions among all captions, ties pessimistic;
    -1 for an image without captions (it takes no part in image->text recall).

    scores: [n_text, n_image] (computed with the image as query where the score depends on it).
    Given the matrix, each image's best own score is read off it first and the count runs over
    contiguous row chunks (column tiles of a held matrix are strided, and slower); the same
    ranks as ``image_to_text_ranks_tiled`` (tests/test_readout.py).
    """
    _check_matrix(scores, text_to_image, "i2t scores")
    n_text, n_image = scores.shape
    t2i = text_to_image.long().to(scores.device)
    right = scores.gather(1, t2i[:, None]).squeeze(1)  # [n_text] each caption's own pair
    best = torch.full((n_image,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, t2i, right, reduce="amax")
    # own captions at least as high as the best own one (the best itself and exact ties)
    right_at_best = torch.zeros(n_image, dtype=torch.long, device=scores.device)
    right_at_best.scatter_add_(0, t2i, (right >= best[t2i]).long())
    at_least = torch.zeros(n_image, dtype=torch.long, device=scores.device)
    rows = max(1, PAIR_BUDGET // max(1, n_image))
    for start in range(0, n_text, rows):
        at_least += (scores[start : start + rows] >= best[None, :]).sum(0)
    ranks = at_least - right_at_best
    ranks[torch.bincount(t2i, minlength=n_image) == 0] = -1
    return ranks.cpu()


@torch.no_grad()
def retrieval_ranks(
    recipe: Recipe,
    texts: Embedding,
    images: Embedding,
    text_to_image: Tensor,
    budget: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(text->image ranks [Nt], image->text ranks [Ni], -1 for images without captions) with
    ``recipe.scores``, each direction with its own query side, in tiles of at most ``budget``
    pairs (default ``PAIR_BUDGET``): memory bounded by the budget, not by Nt x Ni."""
    n_text, n_image = embedding_size(texts), embedding_size(images)
    t2i = text_to_image.long().cpu()
    if n_text and (int(t2i.min()) < 0 or int(t2i.max()) >= n_image):
        raise InputError(f"text_to_image holds image ids outside [0, {n_image})")
    t_ranks = text_to_image_ranks_tiled(
        recipe_score_tile(recipe, texts, images, "text"), n_text, n_image, t2i, budget, "scores"
    )
    i_ranks = image_to_text_ranks_tiled(
        recipe_score_tile(recipe, texts, images, "image"),
        n_text,
        n_image,
        t2i,
        budget,
        "i2t scores",
    )
    return t_ranks, i_ranks


def recall_from_ranks(
    t_ranks: Tensor, i_ranks: Tensor, ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
    """{"t2i@k": ..., "i2t@k": ...} in [0, 1] from ranks of the true match (0 = first): the share
    of queries whose rank is below k; images of rank -1 (no caption) are left out of i2t; NaN
    when a direction has no query."""
    if any(int(k) < 1 for k in ks):
        raise InputError(f"ks must be positive integers, got {list(ks)}")
    i_ranks = i_ranks[i_ranks >= 0]
    out: dict[str, float] = {}
    for k in ks:
        out[f"t2i@{k}"] = float((t_ranks < k).float().mean()) if len(t_ranks) else float("nan")
    for k in ks:
        out[f"i2t@{k}"] = float((i_ranks < k).float().mean()) if len(i_ranks) else float("nan")
    return out


__all__ = [
    "PAIR_BUDGET",
    "POOLED_PARTS",
    "MemoryBudgetError",
    "ScoreTile",
    "check_input_widths",
    "embed_features",
    "embed_rows",
    "embed_store_part",
    "embed_store_rows",
    "image_to_text_ranks",
    "image_to_text_ranks_tiled",
    "input_width_problem",
    "recall_from_ranks",
    "recipe_device",
    "recipe_score_tile",
    "retrieval_ranks",
    "score_matrix",
    "text_to_image_ranks",
    "text_to_image_ranks_tiled",
]
