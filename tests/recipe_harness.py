"""A tiny training loop straight over the Recipe API, for recipe tests (no trainer involved).

    fit(recipe, store, steps, batch_size=64, lr=1e-3, seed=0) -> list[float]   per-step losses
    heldout_recall_at_1(recipe, store, split="test") -> float                 text->image R@1
    small_world(seed=0, ...) -> FeatureStore                                  a small test world

Each step samples ``batch_size`` distinct train images, one random caption each (and one random
box each when the recipe requires "boxes"; ``batch_size`` random scored text pairs when it
requires "text_pairs"), and takes an AdamW step on ``recipe.loss``.
Parameters named by ``recipe.no_decay_parameter_names()`` get no weight decay.

``small_world`` uses the project's synthetic world (``curvalign.data.synthetic``) when it is
importable, and otherwise a local stand-in built here: latent concept vectors, images and
captions as two different fixed random nonlinear maps of them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from curvalign.data.features import FeatureStore, TextPart
from curvalign.recipes.base import Batch, Progress, Recipe


def _grouped(owner: Tensor, n_owners: int) -> list[Tensor]:
    return [torch.nonzero(owner == i).flatten() for i in range(n_owners)]


def _pick_one(groups: list[Tensor], owners: Tensor, generator: torch.Generator) -> Tensor:
    picks = []
    for i in owners.tolist():
        g = groups[i]
        picks.append(g[torch.randint(len(g), (1,), generator=generator)])
    return torch.cat(picks)


def _usable_train_images(
    store: FeatureStore, need_boxes: bool
) -> tuple[Tensor, list[Tensor], list[Tensor] | None]:
    captions = _grouped(store.text_to_image, store.num_images)
    boxes = _grouped(store.box_to_image, store.num_images) if need_boxes else None
    train = (
        store.split_image_ids("train")
        if store.split_names and "train" in store.split_names
        else torch.arange(store.num_images)
    )
    keep = [i for i in train.tolist() if len(captions[i]) and (boxes is None or len(boxes[i]))]
    return torch.tensor(keep, dtype=torch.long), captions, boxes


def fit(
    recipe: Recipe,
    store: FeatureStore,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    weight_decay: float = 0.0,
) -> list[float]:
    """Train ``recipe`` in place for ``steps`` AdamW steps; returns the loss of every step."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    need_boxes = "boxes" in recipe.requires
    if need_boxes and not store.has_boxes:
        raise ValueError(f"recipe {recipe.name} requires boxes; the store has none")
    if "text_pairs" in recipe.requires and not store.has_text_pairs:
        raise ValueError(f"recipe {recipe.name} requires scored text pairs; the store has none")
    images, captions, boxes = _usable_train_images(store, need_boxes)
    if len(images) < batch_size:
        raise ValueError(f"only {len(images)} usable train images for batch_size {batch_size}")
    no_decay = recipe.no_decay_parameter_names()
    params = dict(recipe.named_parameters())
    groups = [
        {
            "params": [p for n, p in params.items() if n not in no_decay],
            "weight_decay": weight_decay,
        },
        {"params": [p for n, p in params.items() if n in no_decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.98))
    recipe.train()
    losses: list[float] = []
    for step in range(steps):
        chosen = images[torch.randperm(len(images), generator=generator)[:batch_size]]
        text_rows = _pick_one(captions, chosen, generator)
        batch = Batch(
            image=store.image_features[chosen].float(), text=store.text_features[text_rows].float()
        )
        if boxes is not None:
            box_rows = _pick_one(boxes, chosen, generator)
            batch.box_image = store.box_image_features[box_rows].float()
            batch.box_text = store.box_text_features[box_rows].float()
        if "text_pairs" in recipe.requires:
            pairs = torch.randperm(store.pair_a_features.shape[0], generator=generator)[:batch_size]
            batch.pair_a = store.pair_a_features[pairs].float()
            batch.pair_b = store.pair_b_features[pairs].float()
            batch.pair_score = store.pair_scores[pairs].float()
        recipe.on_step_start(Progress(step, steps))
        out = recipe.loss(batch, Progress(step, steps))
        if not torch.isfinite(out.total):
            raise FloatingPointError(
                f"{recipe.name}: non-finite loss at step {step}: "
                f"{ {k: float(v) for k, v in out.terms.items()} }"
            )
        optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        optimizer.step()
        losses.append(float(out.total.detach()))
    recipe.eval()
    return losses


@torch.no_grad()
def heldout_recall_at_1(recipe: Recipe, store: FeatureStore, split: str = "test") -> float:
    """Text->image R@1 on ``split``, one caption per image (its first), with ``recipe.scores``."""
    recipe.eval()
    image_ids = store.split_image_ids(split)
    captions = _grouped(store.text_to_image, store.num_images)
    image_ids = torch.tensor([i for i in image_ids.tolist() if len(captions[i])], dtype=torch.long)
    text_ids = torch.stack([captions[i][0] for i in image_ids.tolist()])
    images = recipe.embed_images(store.image_features[image_ids].float())
    texts = recipe.embed_texts(store.text_features[text_ids].float())
    scores = recipe.scores(texts, images, query="text")
    hits = scores.argmax(dim=1) == torch.arange(len(image_ids))
    return float(hits.float().mean())


@torch.no_grad()
def zero_shot_accuracy(recipe: Recipe, store: FeatureStore, split: str = "test") -> float:
    """Top-1 accuracy of ``recipe.zero_shot_scores`` on the labelled images of ``split``."""
    recipe.eval()
    ids = store.split_image_ids(split)
    ids = ids[store.image_labels[ids] >= 0]
    images = recipe.embed_images(store.image_features[ids].float())
    prompts = recipe.embed_texts(store.prompt_features.float())
    num_classes = len(store.class_names)
    scores = recipe.zero_shot_scores(images, prompts, store.prompt_to_class, num_classes)
    assert scores.shape == (len(ids), num_classes)
    return float((scores.argmax(dim=1) == store.image_labels[ids]).float().mean())


def standin_world(
    seed: int = 0,
    num_concepts: int = 24,
    num_images: int = 480,
    captions_per_image: int = 2,
    latent_dim: int = 16,
    image_dim: int = 48,
    text_dim: int = 40,
    num_templates: int = 3,
    test_fraction: float = 0.25,
) -> FeatureStore:
    """A small world with known structure: every image shows two concepts (one of which is its
    label); image features are one fixed random MLP of the summed concept vectors plus noise,
    captions another MLP of a noisier, partial (more general) view; boxes show one concept;
    prompts are the class's concept vector through the text map with template noise."""
    g = torch.Generator().manual_seed(seed)
    concepts = torch.randn(num_concepts, latent_dim, generator=g)

    def random_map(out_dim: int) -> callable:
        w1 = torch.randn(latent_dim, 64, generator=g) / math.sqrt(latent_dim)
        w2 = torch.randn(64, out_dim, generator=g) / 8.0
        return lambda z: torch.tanh(z @ w1) @ w2

    image_map, text_map = random_map(image_dim), random_map(text_dim)
    first = torch.randint(num_concepts, (num_images,), generator=g)
    second = (
        first + 1 + torch.randint(num_concepts - 1, (num_images,), generator=g)
    ) % num_concepts
    scene = concepts[first] + concepts[second]
    image_features = image_map(scene + 0.1 * torch.randn(num_images, latent_dim, generator=g))

    text_to_image = torch.arange(num_images).repeat_interleave(captions_per_image)
    mention_second = torch.rand(len(text_to_image), generator=g) < 0.7
    caption_latent = (
        concepts[first[text_to_image]]
        + mention_second.unsqueeze(1) * concepts[second[text_to_image]]
    )
    text_features = text_map(
        caption_latent + 0.1 * torch.randn(len(text_to_image), latent_dim, generator=g)
    )

    box_to_image = torch.arange(num_images)
    box_concept = torch.where(torch.rand(num_images, generator=g) < 0.5, first, second)
    box_image_features = image_map(
        concepts[box_concept] + 0.1 * torch.randn(num_images, latent_dim, generator=g)
    )
    box_text_features = text_map(concepts[box_concept])

    prompt_to_class = torch.arange(num_concepts).repeat_interleave(num_templates)
    prompt_features = text_map(
        concepts[prompt_to_class]
        + 0.05 * torch.randn(len(prompt_to_class), latent_dim, generator=g)
    )
    image_split = (torch.rand(num_images, generator=g) < test_fraction).long()
    return FeatureStore(
        image_features=image_features,
        text=TextPart(text_features),
        text_to_image=text_to_image,
        image_split=image_split,
        split_names=["train", "test"],
        box_image_features=box_image_features,
        box_text_features=box_text_features,
        box_to_image=box_to_image,
        class_names=[f"concept{i}" for i in range(num_concepts)],
        prompt=TextPart(prompt_features),
        prompt_to_class=prompt_to_class,
        image_labels=first,
        meta={"source": "tests/recipe_harness.standin_world", "seed": seed},
    )


def small_world(seed: int = 0, images: int = 400, **overrides) -> FeatureStore:
    """A small synthetic world (``curvalign.data.synthetic``): 400 images, 36 classes, small
    feature dimensions, so a recipe trains in a second or two on one core."""
    from curvalign.data.synthetic import SyntheticConfig, make_world

    settings = dict(
        images=images,
        captions_min=2,
        captions_max=3,
        text_pairs=64,
        templates=3,
        test_fraction=0.25,
        families=4,
        depth=2,
        branching=3,
        latent_dim=32,
        image_dim=48,
        text_dim=40,
        hidden_dim=64,
        seed=seed,
    )
    settings.update(overrides)
    return make_world(SyntheticConfig(**settings))
