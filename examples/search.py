"""Search a trained run with free text, through the Python API.

    python examples/search.py RUN_DIR INDEX_DIR "a dog on a skateboard" ["another query" ...]
        [--k 5] [--image PHOTO.jpg]

RUN_DIR is a run trained on a store made by `curvalign extract` (it records its local
encoder); INDEX_DIR an index of its embeddings (`curvalign embed`, `curvalign index build`).
The same on the command line: `curvalign search RUN_DIR --index INDEX_DIR "a dog"`.
"""

from __future__ import annotations

import argparse

from curvalign.index.searcher import Searcher


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir")
    parser.add_argument("index_dir")
    parser.add_argument("queries", nargs="*")
    parser.add_argument("--image", action="append", default=[])
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()

    searcher = Searcher.open(args.run_dir, args.index_dir)  # the run's own encoder
    results = searcher.search_texts(args.queries, k=args.k) if args.queries else []
    results += searcher.search_images(args.image, k=args.k) if args.image else []
    for result in results:
        print(f"{result.query!r} ({result.ranked_by}):")
        for hit in result.hits:
            value = hit.distance if hit.distance is not None else hit.score
            where = hit.item.path or f"row {hit.id}"
            print(f"  {hit.rank}. {value:.4f}  {where}  {hit.item.caption or ''}")


if __name__ == "__main__":
    main()
