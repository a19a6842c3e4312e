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
   recall@k of proxy candidates + exact rerank against the exhaustive ``recipe.scores`` ranking
   (``exhaustive_topk``), and latency per query of the search and of its two stages, for K
   candidates in --rerank-candidates; the search and the exhaustive ranking are timed in
   ``--rounds`` interleaved rounds after a warm-up (medians; the speed-up's range over rounds).
4. Recall vs candidates (``--sections candidates``) on embeddings whose norms spread over two
   orders of magnitude (points near the boundary): the flat proxy scan, the HNSW candidate graph
   built on Poincare-ball coordinates (``RecipeIndex(candidate_index="hnsw")``), and a plain
   inner-product HNSW on the proxy vectors (the reduced-MIPS graph that fails near the boundary),
   so that ``--candidates`` can be picked from a measurement. Text queries over an image database
   for ``--recipes``, image queries over a text database for ``--image-queries`` (default AtMG
   with either ``image_query_score``: the angle at the database item, or at the query). Recall is
   against the float32 exhaustive ranking; two more columns compare the flat search and that
   reference with a float64 exhaustive ranking (float32 cannot separate far-out points).
5. Search a person can use (``--sections service``): queries per second of ``Searcher`` end to
   end from text, with the encoder step excluded (precomputed features) and included (a tiny
   local open_clip text tower), and of the HTTP service (``curvalign serve``'s app under uvicorn
   on the loopback, a bounded loop of ``--concurrency`` clients); exact vs ANN vs rerank. The
   three modes are measured in interleaved rounds, so their ratios share the machine's load.

Data: synthetic Lorentz points with cluster structure (``expmap0`` of cluster centres plus noise;
queries nearer the origin along the same directions, like captions vs images). The rerank
section feeds clustered features (images and captions share cluster centres) through
randomly initialised recipes, so the embeddings keep the clusters.

    python benchmarks/search.py                        # the issue's sizes: N = 1M, d = 64 and 512
    python benchmarks/search.py --n 100000 --dims 64   # smaller
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import faiss
import numpy as np
import torch

from curvalign.errors import InputError
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


@torch.no_grad()
def score_matrix(recipe, texts, images, chunk: int = 256) -> None:
    """The exhaustive ranking's floor: ``recipe.scores`` of every query block, no selection."""
    n = next(iter(texts.values())).shape[0]
    for start in range(0, n, chunk):
        recipe.scores({k: v[start : start + chunk] for k, v in texts.items()}, images, query="text")


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
        _, want = exhaustive_topk(recipe, texts, images, "images", args.k)  # also a warm-up
        engine = RecipeIndex(recipe, images, "images")
        got = {K: engine.search(texts, args.k, K)[1] for K in args.rerank_candidates}  # warm-up
        # Interleaved rounds: each round times the exhaustive ranking, then per K the search and
        # its two stages, so that every ratio shares the machine's load of that round.
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            times.setdefault("full", []).append(
                timed(lambda: exhaustive_topk(recipe, texts, images, "images", args.k))[0]
            )
            times.setdefault("matrix", []).append(
                timed(lambda: score_matrix(recipe, texts, images))[0]
            )
            for K in args.rerank_candidates:
                times.setdefault(f"search{K}", []).append(
                    timed(lambda: engine.search(texts, args.k, K))[0]
                )
                t_cand, cand = timed(lambda: engine.candidates(texts, K))
                t_rerank, _ = timed(lambda: engine.rerank(texts, cand, args.k))
                times.setdefault(f"cand{K}", []).append(t_cand)
                times.setdefault(f"rerank{K}", []).append(t_rerank)
        full = np.array(times["full"])
        for K in args.rerank_candidates:
            t = np.array(times[f"search{K}"])
            rows.append(
                [
                    name,
                    engine.proxy.name,
                    args.rerank_n,
                    K,
                    recall(got[K], want),
                    1e3 * float(np.median(times[f"cand{K}"])) / args.queries,
                    1e3 * float(np.median(times[f"rerank{K}"])) / args.queries,
                    1e3 * float(np.median(t)) / args.queries,
                    1e3 * float(np.median(full)) / args.queries,
                    1e3 * float(np.median(times["matrix"])) / args.queries,
                    float(np.median(full / t)),
                    f"{(full / t).min():.3g}-{(full / t).max():.3g}",
                ]
            )
    table(
        f"Rerank with the recipe's own score (text -> image), recall@{args.k} against exhaustive "
        f"recipe.scores; random-init recipes on clustered features; {args.queries} queries, "
        f"medians of {args.rounds} interleaved rounds",
        [
            "recipe",
            "proxy",
            "N images",
            "K",
            f"recall@{args.k}",
            "ms/q candidates",
            "ms/q rerank",
            "ms/q search",
            "ms/q exhaustive",
            "ms/q score matrix alone",
            "speed-up (median)",
            "speed-up (range over rounds)",
        ],
        rows,
    )


# --- 4. recall vs candidates on widely spread norms ---------------------------------------------


def spread_features(n: int, dim: int, seed: int, decades: float = 2.0) -> torch.Tensor:
    """Clustered features whose norms spread over ``decades`` orders of magnitude, so the recipes'
    points reach from near the origin to near the boundary."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(50, dim, generator=g)
    x = centres[torch.randint(0, 50, (n,), generator=g)] + 0.4 * torch.randn(n, dim, generator=g)
    return x * 10 ** (decades * torch.rand(n, 1, generator=g) - 0.5)


def naive_ip_hnsw(vectors: np.ndarray, M: int, ef_construction: int, ef_search: int):
    """HNSW built and searched by the inner product of the proxy vectors themselves."""
    index = faiss.IndexHNSWFlat(vectors.shape[1], M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    index.add(vectors)
    index.hnsw.efSearch = ef_search
    return index


def _recipe_spec(spec: str) -> tuple[str, dict]:
    """``NAME[:FIELD=VALUE,...]``: a recipe name and config overrides (strings)."""
    name, _, rest = spec.partition(":")
    return name, dict(item.split("=", 1) for item in rest.split(",") if item)


def recall_vs_candidates(args: argparse.Namespace) -> None:
    rows = []
    image_dim, text_dim = 64, 48
    image_feats = spread_features(args.candidates_n, image_dim, 1)
    text_feats = spread_features(args.queries, text_dim, 2) * 0.3
    # image queries: a text database spread like the text queries, images as queries
    text_db_feats = spread_features(args.candidates_n, text_dim, 3) * 0.3
    image_query_feats = spread_features(args.queries, image_dim, 4)
    runs = [(spec, "text") for spec in args.recipes]
    runs += [(spec, "image") for spec in args.image_queries]
    for spec, query in runs:
        name, overrides = _recipe_spec(spec)
        torch.manual_seed(0)
        cls = get_recipe(name)
        recipe = cls(cls.Config(**overrides), image_dim, text_dim).eval()
        with torch.no_grad():
            if query == "text":
                side = "images"
                database = {k: v.contiguous() for k, v in recipe.embed_images(image_feats).items()}
                queries = recipe.embed_texts(text_feats)
            else:
                side = "texts"
                database = {k: v.contiguous() for k, v in recipe.embed_texts(text_db_feats).items()}
                queries = recipe.embed_images(image_query_feats)
        _, want = exhaustive_topk(recipe, queries, database, side, args.k)
        # the same ranking in float64: float32 cannot separate the far-out points (ties at the
        # clamps of the exhaustive score), so the float32 reference can be wrong itself
        f64 = lambda emb: {k: v.double() for k, v in emb.items()}  # noqa: E731
        _, want64 = exhaustive_topk(
            copy.deepcopy(recipe).double(), f64(queries), f64(database), side, args.k
        )
        flat = RecipeIndex(recipe, database, side)
        t_graph, graph = timed(
            lambda: RecipeIndex(
                recipe,
                database,
                side,
                candidate_index="hnsw",
                M=args.M,
                ef_construction=args.ef_construction,
                ef_search=args.ef_search,
            )
        )
        vectors = flat.proxy.database(flat.database)
        t_naive, naive_index = timed(
            lambda: naive_ip_hnsw(vectors, args.M, args.ef_construction, args.ef_search)
        )
        naive = RecipeIndex(recipe, database, side, proxy_index=naive_index)
        for K in args.candidate_grid:
            line = [spec, f"{query} -> {side[:-1]}", flat.proxy.name, args.candidates_n, K]
            times = []
            for engine in (flat, graph, naive):
                t, (_, got) = timed(lambda: engine.search(queries, args.k, K))
                line.append(recall(got, want))
                times.append(1e3 * t / args.queries)
                if engine is flat:
                    flat_vs_f64 = recall(got, want64)
            rows.append(line + [flat_vs_f64, recall(want, want64)] + times)
        print(
            f"{spec} ({query} queries): candidate graph built in {t_graph:.1f} s, "
            f"plain IP HNSW in {t_naive:.1f} s",
            flush=True,
        )
    table(
        f"Recall@{args.k} vs candidates K on norms spread over two decades (random-init recipes; "
        f"HNSW M={args.M}, ef_construction={args.ef_construction}, ef_search={args.ef_search})",
        [
            "recipe",
            "query",
            "proxy",
            "N",
            "K",
            "recall flat proxy",
            "recall HNSW on ball coords",
            "recall plain IP HNSW",
            "recall flat vs float64",
            "float32 reference vs float64",
            "ms/q flat",
            "ms/q ball HNSW",
            "ms/q IP HNSW",
        ],
        rows,
    )


# --- 5. queries per second of the search front ---------------------------------------------------


def _tiny_text_encoder(root, embed_dim: int) -> str:
    """A tiny random open_clip model written to ``root`` (never downloaded); its spec."""
    import json

    from curvalign.data import encoders

    encoders._make_torchvision_importable()
    import open_clip

    config = root / "bench-tiny-clip.json"
    config.write_text(
        json.dumps(
            {
                "embed_dim": embed_dim,
                "vision_cfg": {
                    "image_size": 32,
                    "layers": 1,
                    "width": 32,
                    "head_width": 16,
                    "patch_size": 16,
                },
                "text_cfg": {
                    "context_length": 16,
                    "vocab_size": 49408,
                    "width": 64,
                    "heads": 2,
                    "layers": 2,
                },
            }
        )
    )
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    checkpoint = root / "bench-tiny-clip.pt"
    torch.save(open_clip.create_model("bench-tiny-clip").state_dict(), checkpoint)
    return f"open_clip:{config}:{checkpoint}"


def _searchable_run(root, recipe: str, dim: int, n: int, kinds: list[tuple[str, dict]]):
    """A run of ``recipe`` on ``dim``-dim features, N database items embedded through its head,
    and one index per ``(name, build options)``."""
    from curvalign.data.features import FeatureStore, TextPart
    from curvalign.index.embed import build_from_embeddings, embed_store, load_embeddings
    from curvalign.runs import load_run
    from curvalign.train.trainer import train

    g = torch.Generator().manual_seed(3)
    small = FeatureStore(
        image_features=torch.randn(64, dim, generator=g),
        text=TextPart(torch.randn(64, dim, generator=g)),
        text_to_image=torch.arange(64),
    )
    run_dir = train(
        recipe,
        small,
        root / f"run-{recipe}",
        steps=1,
        overrides=["batch_size=32", f"embed_dim={dim}"],
        show_progress=False,
    )
    run = load_run(run_dir)
    database = FeatureStore(
        image_features=spread_features(n, dim, 4, decades=1.0),
        text=TextPart(torch.randn(8, dim, generator=g)),
        text_to_image=torch.zeros(8, dtype=torch.long),
    )
    emb = embed_store(
        run.recipe,
        database,
        root / f"emb-{recipe}",
        batch_size=65536,
        info={"run_dir": str(run_dir), "step": run.step},
    )
    out = {}
    for name, options in kinds:
        out[name] = build_from_embeddings(
            load_embeddings(emb), root / f"idx-{recipe}-{name}", **options
        )
    return run_dir, out


def service_qps(args: argparse.Namespace) -> None:
    import tempfile
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx
    import uvicorn

    from curvalign.index.searcher import Searcher
    from curvalign.index.serve import make_app

    root = Path(tempfile.mkdtemp(prefix="curvalign-bench-"))
    dim = args.service_dim
    spec = _tiny_text_encoder(root, dim)
    hnsw = {
        "kind": "ann",
        "method": "hnsw",
        "M": args.M,
        "ef_construction": args.ef_construction,
        "ef_search": args.ef_search,
    }
    t0 = time.perf_counter()
    meru_run, meru = _searchable_run(root, "meru", dim, args.service_n, [("exact", {})])
    (root / "ann").mkdir()
    _, meru_ann = _searchable_run(root / "ann", "meru", dim, args.service_ann_n, [("hnsw", hnsw)])
    atmg_run, atmg = _searchable_run(
        root, "atmg", dim, args.service_rerank_n, [("flat", {}), ("hnsw", hnsw)]
    )
    print(
        f"service section: data, runs and indexes built in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    configs = [
        ("exact (certified Lorentz)", meru_run, meru["exact"], args.service_n),
        ("ANN (HNSW, ball graph)", meru_run, meru_ann["hnsw"], args.service_ann_n),
        ("rerank atmg, flat candidates", atmg_run, atmg["flat"], args.service_rerank_n),
        ("rerank atmg, HNSW candidates", atmg_run, atmg["hnsw"], args.service_rerank_n),
    ]
    searchers = [
        Searcher.open(run, idx, encoder=spec, candidates=args.service_candidates, items=False)
        for _, run, idx, _ in configs
    ]
    words = ["dog", "cat", "skateboard", "tree"]
    queries = [f"a photo of a {words[i % 4]} number {i}" for i in range(args.service_queries)]
    encoder = searchers[0].encoder()
    with torch.no_grad():
        features = encoder.encode_texts(queries).numpy()
    for s in searchers[1:]:
        s._encoder = encoder  # one model in memory
    servers, urls = [], []
    for s in searchers:
        port = _free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                make_app(s), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
            )
        )
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        servers.append(server)
        urls.append(f"http://127.0.0.1:{port}/search")
    totals = np.zeros((len(configs), 3))
    counts = np.zeros((len(configs), 3))
    per_round = max(1, args.service_queries // args.rounds)
    client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=args.concurrency))
    for r in range(args.rounds):
        batch = list(range(r * per_round, min(len(queries), (r + 1) * per_round)))
        for c, s in enumerate(searchers):
            t = time.perf_counter()
            for i in batch:
                s.search_features(features[i : i + 1], "text", args.k)
            totals[c, 0] += time.perf_counter() - t
            t = time.perf_counter()
            for i in batch:
                s.search_texts([queries[i]], args.k)
            totals[c, 1] += time.perf_counter() - t
            t = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                replies = list(
                    pool.map(
                        lambda i: client.post(urls[c], json={"text": queries[i], "k": args.k}),
                        batch,
                    )
                )
            totals[c, 2] += time.perf_counter() - t
            assert all(reply.status_code == 200 for reply in replies), replies[0].text
            counts[c] += len(batch)
    client.close()
    for server in servers:
        server.should_exit = True
    qps = counts / totals
    rows = []
    for c, (name, _, _, n) in enumerate(configs):
        rows.append(
            [
                name,
                n,
                qps[c, 0],
                qps[c, 1],
                qps[c, 2],
                qps[c, 1] / qps[c, 0],
                qps[c, 2] / qps[c, 1],
                qps[c, 0] / qps[0, 0],
            ]
        )
    table(
        f"Queries per second of search from text, top-{args.k}, one query per call "
        f"({int(counts[0, 0])} queries per mode in {args.rounds} interleaved rounds; HTTP: "
        f"{args.concurrency} concurrent clients on the loopback; tiny {dim}-d open_clip text "
        f"tower; rerank K = {args.service_candidates})",
        [
            "index",
            "N",
            "q/s encoder excluded",
            "q/s encoder included",
            "q/s HTTP",
            "included / excluded",
            "HTTP / in-process",
            "excluded vs exact",
        ],
        rows,
    )


def real_store(args: argparse.Namespace) -> None:
    """Approximate against exact search on a real store: a MERU run trained ``--real-steps``
    steps on ``--real-data``, its image side (Lorentz points) indexed, every text (up to
    ``--real-queries``) a query. Recall@10 of HNSW (``ef_search`` grid) and of the
    Lorentz-Voronoi IVF (``nprobe`` grid) against the exact index, and ms per query (a batch
    of all queries, best of ``--repeat``)."""
    import tempfile
    from pathlib import Path

    from curvalign.data import load_data
    from curvalign.index.embed import embed_store, load_embeddings
    from curvalign.runs import load_run
    from curvalign.train.trainer import train

    with tempfile.TemporaryDirectory() as root:
        run_dir = train(
            "meru",
            args.real_data,
            Path(root) / "run",
            steps=args.real_steps,
            show_progress=False,
        )
        run = load_run(run_dir, weights="best")
        store = load_data(args.real_data)
        embed_store(run.recipe, store, Path(root) / "emb")
        emb = load_embeddings(Path(root) / "emb")
        key = emb.meta["lorentz_index_key"]
        points = np.asarray(emb.side("images")[key])
        texts = np.asarray(emb.side("texts")[key])
        c = float(emb.curvature[0])
    rng = np.random.default_rng(0)
    take = rng.choice(len(texts), size=min(len(texts), args.real_queries), replace=False)
    queries = texts[np.sort(take)]
    k = args.k
    print(
        f"\n{args.real_data}: {len(points):,} images indexed (Lorentz, d = {points.shape[1]}, "
        f"c = {c:.3g}), {len(queries):,} text queries, meru trained {args.real_steps} steps, "
        f"{faiss.omp_get_max_threads()} Faiss threads"
    )
    exact = build_index(points, c)
    t_exact, (_, want) = timed(lambda: exact.search(queries, k), args.repeat)
    ms = lambda t: 1000 * t / len(queries)  # noqa: E731
    rows = [["exact", "", f"{ms(t_exact):.3f}", "1.000", ""]]
    t0 = time.perf_counter()
    hnsw = build_index(points, c, kind="ann", method="hnsw", M=args.M, ef_construction=80)
    built = time.perf_counter() - t0
    for ef in args.real_ef:
        hnsw.set_options(ef_search=ef)
        t, (_, got) = timed(lambda: hnsw.search(queries, k), args.repeat)
        rows.append(
            [
                f"hnsw M={args.M}",
                f"ef_search={ef}",
                f"{ms(t):.3f}",
                f"{recall(got, want):.3f}",
                f"{built:.1f}",
            ]
        )
    t0 = time.perf_counter()
    ivf = build_index(points, c, kind="ann", method="ivf", nlist=args.nlist)
    built = time.perf_counter() - t0
    for nprobe in args.real_nprobe:
        ivf.set_options(nprobe=nprobe)
        try:
            t, (_, got) = timed(lambda: ivf.search(queries, k), args.repeat)
        except InputError:  # the probed cells hold fewer than k points for some query
            rows.append(
                [
                    f"ivf nlist={ivf.info.options['nlist']}",
                    f"nprobe={nprobe}",
                    "",
                    f"< {k} found",
                    f"{built:.1f}",
                ]
            )
            continue
        rows.append(
            [
                f"ivf nlist={ivf.info.options['nlist']}",
                f"nprobe={nprobe}",
                f"{ms(t):.3f}",
                f"{recall(got, want):.3f}",
                f"{built:.1f}",
            ]
        )
    table(
        f"Approximate vs exact on {args.real_data}, recall@{k}",
        ["index", "search option", "ms/query", f"recall@{k}", "build s"],
        rows,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    p.add_argument(
        "--skip-exact",
        action="store_true",
        help="only the rerank section (the same as --sections rerank; ignored with --sections)",
    )
    p.add_argument(
        "--sections",
        nargs="+",
        default=None,
        choices=["exact", "rerank", "candidates", "service", "real"],
        help="default: all four (--skip-exact: rerank only)",
    )
    p.add_argument("--candidates-n", type=int, default=50_000, help="items, section 4")
    p.add_argument(
        "--image-queries",
        nargs="*",
        default=["atmg", "atmg:image_query_score=beta"],
        help="section 4: recipes also measured with image queries over a text database "
        "(NAME[:FIELD=VALUE,...] sets config fields)",
    )
    p.add_argument(
        "--candidate-grid", type=int, nargs="+", default=[10, 20, 50, 100, 200, 500, 1000]
    )
    p.add_argument("--service-n", type=int, default=1_000_000, help="exact index size, section 5")
    p.add_argument("--service-ann-n", type=int, default=100_000, help="HNSW index size, section 5")
    p.add_argument("--service-rerank-n", type=int, default=100_000, help="rerank size, section 5")
    p.add_argument("--service-dim", type=int, default=64)
    p.add_argument("--service-queries", type=int, default=200)
    p.add_argument("--service-candidates", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds, sections 3 and 5")
    p.add_argument("--concurrency", type=int, default=8, help="HTTP clients, section 5")
    p.add_argument(
        "--real-data", default="wordnet:artifact.n.01", help="the store of --sections real"
    )
    p.add_argument("--real-steps", type=int, default=200, help="meru steps, --sections real")
    p.add_argument("--real-queries", type=int, default=2000, help="text queries, --sections real")
    p.add_argument("--real-ef", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--real-nprobe", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = p.parse_args()
    if args.sections is None:
        args.sections = (
            ["rerank"] if args.skip_exact else ["exact", "rerank", "candidates", "service"]
        )
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(
        f"# curvalign search benchmark\n\nfaiss {faiss.__version__}, torch {torch.__version__}, "
        f"{faiss.omp_get_max_threads()} Faiss threads, {torch.get_num_threads()} torch threads"
    )
    if "exact" in args.sections:
        exact_and_ann(args)
    if args.recipes and "rerank" in args.sections:
        rerank(args)
    if args.recipes and "candidates" in args.sections:
        recall_vs_candidates(args)
    if "service" in args.sections:
        service_qps(args)
    if "real" in args.sections:
        real_store(args)


if __name__ == "__main__":
    main()
