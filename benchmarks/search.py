"""Retrieval serving benchmark: exact and approximate Lorentz search, and rerank with recipe scores.

Everything is measured in one run and printed as Markdown tables (see docs/search.md):

1. Exact Lorentz search through the Faiss transform (``build_index(kind="exact")``) against
   (a) a torch brute force (``geometry.lorentz.pairwise_dist`` in chunks + ``topk``) and (b) Faiss
   flat inner-product search on the same transformed vectors without the certified float64
   rerank. Reports time per query batch, speed ratios, and whether the top-k ids equal a
   float64 brute-force ranking (ties by id).
2. Approximate search (HNSW on the ball-coordinate graph, Lorentz-Voronoi IVF): recall@k against
   exact, speed-up, build time.
3. Rerank with the recipes' own scores (AtMG angle, PHyCLIP l1 product, AGR routed score):
   recall@k of proxy candidates + exact rerank against the exhaustive ``recipe.scores`` ranking,
   and latency per query, for K candidates in --rerank-candidates.

Data: synthetic Lorentz points with cluster structure (``expmap0`` of cluster centres plus noise;
queries nearer the origin along the same directions, like captions vs images). The rerank
section feeds clustered features (images and captions share cluster centres) through
randomly initialised recipes, so the embeddings keep the clusters.

    python benchmarks/search.py                        # the issue's sizes: N = 1M, d = 64 and 512
    python benchmarks/search.py --n 100000 --dims 64   # smaller
"""

from __future__ import annotations

import argparse
import math
import time

import faiss
import numpy as np
import torch

from curvalign.geometry import lorentz
from curvalign.index import RecipeIndex, build_index, exhaustive_topk, query_vectors
from curvalign.recipes import get_recipe


def clustered_lorentz(
    n: int,
    d: int,
    c: float,
    *,
    clusters: int,
    seed: int,
    radius: float = 2.0,
    spread: float = 0.5,
    shrink: float = 1.0,
    chunk: int = 1 << 16,
) -> np.ndarray:
    """``[n, d]`` float32 space components: ``expmap0(shrink * centre + noise)``, generated in chunks."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(12345 + d).standard_normal((clusters, d)).astype(np.float32)
    centres *= radius / np.linalg.norm(centres, axis=1, keepdims=True)
    out = np.empty((n, d), dtype=np.float32)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        v = shrink * centres[rng.integers(0, clusters, m)]
        v += rng.standard_normal((m, d), dtype=np.float32) * (spread / math.sqrt(d))
        r = np.linalg.norm(v, axis=1, keepdims=True).astype(np.float64)
        out[start : start + m] = (np.sinh(math.sqrt(c) * r) / (math.sqrt(c) * r) * v).astype(
            np.float32
        )
    return out


def torch_bruteforce(
    x: np.ndarray, q: np.ndarray, c: float, k: int, dtype=torch.float32, chunk: int = 1 << 16
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by ``lorentz.pairwise_dist`` over chunks of the database; ties by id (stable merge)."""
    Q = torch.from_numpy(q).to(dtype)
    best_d = torch.full((len(q), 0), float("inf"), dtype=dtype)
    best_i = torch.zeros((len(q), 0), dtype=torch.long)
    with torch.no_grad():
        for start in range(0, len(x), chunk):
            X = torch.from_numpy(x[start : start + chunk]).to(dtype)
            D = lorentz.pairwise_dist(Q, X, c)
            d, i = torch.topk(D, min(k, D.shape[1]), dim=1, largest=False, sorted=True)
            cat_d = torch.cat([best_d, d], 1)
            cat_i = torch.cat([best_i, i + start], 1)
            # sort by (distance, id): ids are increasing within the concatenation order per chunk
            order = np.lexsort((cat_i.numpy(), cat_d.double().numpy()), axis=-1)[:, :k]
            best_d = torch.gather(cat_d, 1, torch.from_numpy(order))
            best_i = torch.gather(cat_i, 1, torch.from_numpy(order))
    return best_d.double().numpy(), best_i.numpy()


def recall(got: np.ndarray, want: np.ndarray) -> float:
    return float(
        np.mean(
            [
                len(set(a.tolist()) & set(b.tolist())) / want.shape[1]
                for a, b in zip(got, want, strict=False)
            ]
        )
    )


def timed(fn, repeat: int = 1):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |")


def exact_and_ann(args: argparse.Namespace) -> None:
    exact_rows, ann_rows = [], []
    for d in args.dims:
        t0 = time.perf_counter()
        x = clustered_lorentz(args.n, d, args.c, clusters=args.clusters, seed=d, spread=args.spread)
        q = clustered_lorentz(
            args.queries,
            d,
            args.c,
            clusters=args.clusters,
            seed=10_000 + d,
            shrink=0.7,
            spread=args.spread,
        )
        gen = time.perf_counter() - t0
        build, index = timed(lambda: build_index(x, args.c))
        t_ours, (dist, ids) = timed(lambda: index.search(q, args.k), args.repeat)
        v = query_vectors(q, args.c)
        t_flat, (_, flat_ids) = timed(lambda: index._index.search(v, args.k), args.repeat)
        t_torch, (_, torch_ids) = timed(lambda: torch_bruteforce(x, q, args.c, args.k))
        _, (_, ref_ids) = timed(lambda: torch_bruteforce(x, q, args.c, args.k, dtype=torch.float64))
        exact_rows.append(
            [
                args.n,
                d,
                args.queries,
                f"{gen:.1f} s / {build:.1f} s",
                1e3 * t_ours / args.queries,
                1e3 * t_flat / args.queries,
                t_ours / t_flat,
                1e3 * t_torch / args.queries,
                t_torch / t_ours,
                "yes" if (ids == ref_ids).all() else f"no ({recall(ids, ref_ids):.4f})",
                recall(flat_ids, ref_ids),
                recall(torch_ids, ref_ids),
            ]
        )
        del index
        if args.ann:
            n_ann = min(args.n, args.ann_n)
            xa = x[:n_ann]
            want = ref_ids if n_ann == args.n else build_index(xa, args.c).search(q, args.k)[1]
            base_t, _ = (
                timed(lambda: build_index(xa, args.c).search(q, args.k), 1)
                if n_ann != args.n
                else (t_ours, None)
            )
            for method in args.ann:
                opts = (
                    {
                        "M": args.M,
                        "ef_construction": args.ef_construction,
                        "ef_search": args.ef_search,
                    }
                    if method == "hnsw"
                    else {"nlist": args.nlist, "nprobe": args.nprobe}
                )
                build, ann = timed(
                    lambda: build_index(xa, args.c, kind="ann", method=method, **opts)
                )
                t_ann, (_, got) = timed(lambda: ann.search(q, args.k), args.repeat)
                desc = ", ".join(f"{k}={v}" for k, v in ann.info.options.items())
                ann_rows.append(
                    [
                        n_ann,
                        d,
                        method,
                        desc,
                        f"{build:.1f} s",
                        1e3 * t_ann / args.queries,
                        base_t / t_ann,
                        recall(got, want),
                    ]
                )
                del ann
        del x
    table(
        f"Exact Lorentz search, top-{args.k} (per-query times from a batch of {args.queries} queries, "
        f"{faiss.omp_get_max_threads()} threads)",
        [
            "N",
            "d",
            "queries",
            "generate / build",
            "ours ms/q",
            "Faiss flat IP ms/q",
            "ours / Faiss",
            "torch brute ms/q",
            "torch / ours",
            "top-k = float64 brute force",
            "Faiss IP recall",
            "torch f32 recall",
        ],
        exact_rows,
    )
    if ann_rows:
        table(
            f"Approximate Lorentz search, recall@{args.k} against exact",
            [
                "N",
                "d",
                "method",
                "options",
                "build",
                "ms/q",
                "speed-up vs exact",
                f"recall@{args.k}",
            ],
            ann_rows,
        )


def clustered_features(
    n: int,
    dim: int,
    centres: np.ndarray,
    labels: np.ndarray,
    projection: np.ndarray,
    noise: float,
    seed: int,
) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    latent = centres[labels] + noise * rng.standard_normal((n, centres.shape[1]))
    return torch.from_numpy((latent @ projection).astype(np.float32))


def rerank(args: argparse.Namespace) -> None:
    rows = []
    rng = np.random.default_rng(0)
    latent, image_dim, text_dim = 32, 64, 48
    centres = rng.standard_normal((args.clusters, latent)) * 1.5
    img_proj = rng.standard_normal((latent, image_dim)) / math.sqrt(latent)
    txt_proj = rng.standard_normal((latent, text_dim)) / math.sqrt(latent)
    image_labels = rng.integers(0, args.clusters, args.rerank_n)
    text_labels = rng.integers(0, args.clusters, args.queries)
    image_feats = clustered_features(
        args.rerank_n, image_dim, centres, image_labels, img_proj, 0.6, 1
    )
    text_feats = clustered_features(args.queries, text_dim, centres, text_labels, txt_proj, 0.6, 2)
    for name in args.recipes:
        torch.manual_seed(0)
        cls = get_recipe(name)
        recipe = cls(cls.Config(), image_dim, text_dim).eval()
        with torch.no_grad():
            images = {k: v.contiguous() for k, v in recipe.embed_images(image_feats).items()}
            texts = recipe.embed_texts(text_feats)
        t_full, (_, want) = timed(lambda: exhaustive_topk(recipe, texts, images, "images", args.k))
        build, engine = timed(lambda: RecipeIndex(recipe, images, "images"))
        for K in args.rerank_candidates:
            t, (_, got) = timed(lambda: engine.search(texts, args.k, K))
            rows.append(
                [
                    name,
                    engine.proxy.name,
                    args.rerank_n,
                    K,
                    recall(got, want),
                    1e3 * t / args.queries,
                    1e3 * t_full / args.queries,
                    t_full / t,
                ]
            )
    table(
        f"Rerank with the recipe's own score (text -> image), recall@{args.k} against exhaustive "
        f"recipe.scores; random-init recipes on clustered features",
        [
            "recipe",
            "proxy",
            "N images",
            "K",
            f"recall@{args.k}",
            "ms/q (proxy + rerank)",
            "ms/q exhaustive",
            "speed-up",
        ],
        rows,
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1_000_000, help="database points for exact search")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 512])
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--c", type=float, default=1.0, help="curvature -c of the synthetic points")
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument(
        "--spread",
        type=float,
        default=0.5,
        help="noise norm around the cluster centres (radius 2); larger = less structure, harder ANN",
    )
    p.add_argument("--repeat", type=int, default=1, help="timings: best of this many runs")
    p.add_argument(
        "--ann", nargs="*", default=["hnsw", "ivf"], help="ANN methods to measure (none: skip)"
    )
    p.add_argument(
        "--ann-n",
        type=int,
        default=100_000,
        help="database points for the ANN section (HNSW construction is the slow part on 2 cores)",
    )
    p.add_argument("--M", type=int, default=32)
    p.add_argument("--ef-construction", type=int, default=80)
    p.add_argument("--ef-search", type=int, default=128)
    p.add_argument("--nlist", type=int, default=None)
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--recipes", nargs="*", default=["atmg", "phyclip", "agr"])
    p.add_argument(
        "--rerank-n", type=int, default=20_000, help="database items for the rerank section"
    )
    p.add_argument("--rerank-candidates", type=int, nargs="+", default=[50, 200])
    p.add_argument("--skip-exact", action="store_true", help="only the rerank section")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(
        f"# curvalign search benchmark\n\nfaiss {faiss.__version__}, torch {torch.__version__}, "
        f"{faiss.omp_get_max_threads()} Faiss threads, {torch.get_num_threads()} torch threads"
    )
    if not args.skip_exact:
        exact_and_ann(args)
    if args.recipes:
        rerank(args)


if __name__ == "__main__":
    main()
