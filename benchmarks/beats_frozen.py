"""Does each trained recipe beat the frozen features, and does it leave its step-0 weights?

Reads a benchmark's ``results.json`` (``curvalign benchmark ... --out DIR``) and prints, per
trained recipe: its best step per seed (0 = model selection kept the untrained head), its mean
R@1 (mean of T2I and I2T R@1) per seed, and the difference to the frozen features' mean R@1
with its 95% Student-t interval over seeds (``curvalign.stats.mean_interval``), plus the
step-0 health check's marker per recipe. docs/results.md ("Initialisation that fits the data")
quotes its output.

    python benchmarks/beats_frozen.py DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from curvalign.recipes.health import step0_codes
from curvalign.stats import mean_interval

FROZEN = "frozen features"


def mean_r1(stats: dict) -> list[float]:
    """Per-seed mean of T2I and I2T R@1 (in %) of one row's stats."""
    t2i, i2t = stats["retrieval/t2i@1"], stats["retrieval/i2t@1"]
    values_t = t2i.get("values") or [t2i["mean"]]
    values_i = i2t.get("values") or [i2t["mean"]]
    return [50 * (a + b) for a, b in zip(values_t, values_i, strict=True)]


def report(path: Path) -> list[str]:
    result = json.loads((path / "results.json").read_text())
    stats, rows = result["stats"], result["rows"]
    frozen = mean_r1(stats[FROZEN])[0] if FROZEN in stats else None
    lines = [
        f"{path}: data {result['data']}, {result['steps'] or 'recipe-default'} steps, seeds {result['seeds']}",
        "| recipe | best step per seed | mean R@1 per seed | minus frozen, 95% interval | "
        "step-0 check |",
        "|---|---|---|---|---|",
    ]
    if frozen is not None:
        lines.insert(1, f"frozen features mean R@1: {frozen:.2f}")
    for name, row in rows.items():
        if row.get("kind") != "trained" or name not in stats:
            continue
        values = mean_r1(stats[name])
        diff = "n/a"
        if frozen is not None:
            interval = mean_interval([v - frozen for v in values])
            diff = f"{interval.mean:+.2f} [{interval.low:+.2f}, {interval.high:+.2f}]"
        codes = step0_codes([str(w) for w in row.get("warnings", [])])
        lines.append(
            f"| {name} | {', '.join(map(str, row.get('best_step', [])))} | "
            f"{', '.join(f'{v:.2f}' for v in values)} | {diff} | {', '.join(codes) or 'silent'} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="benchmark output directories")
    for path in parser.parse_args().dirs:
        print("\n".join(report(path)))
        print()


if __name__ == "__main__":
    main()
