"""Sum the suite's CPU-seconds by test file from an ``INFERD_TEST_CPU_LOG`` file
(:mod:`tests.cpu_usage`): ``python scripts/suite_cpu.py log.jsonl [--top 30]``. Prints
the totals (pytest processes, their children, wall) and the files costing most."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for row in rows:
        entry = by_file[row["test"].split("::")[0]]
        entry[0] += row["self_s"]
        entry[1] += row["children_s"]
        entry[2] += row["wall_s"]
        entry[3] += 1
    own = sum(e[0] for e in by_file.values())
    children = sum(e[1] for e in by_file.values())
    wall = sum(e[2] for e in by_file.values())
    print(f"{len(rows)} tests in {len(by_file)} files: CPU {own + children:.0f} s "
          f"(pytest {own:.0f} s, children {children:.0f} s), test wall {wall:.0f} s")  # fmt: skip
    print("\n| file | tests | CPU s | pytest s | children s | wall s |\n|---|---|---|---|---|---|")
    ranked = sorted(by_file.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for name, (o, c, w, n) in ranked[: args.top]:
        print(f"| {name} | {n} | {o + c:.1f} | {o:.1f} | {c:.1f} | {w:.1f} |")


if __name__ == "__main__":
    main()
