"""Sum the suite's CPU-seconds by test file from an ``INFERD_TEST_CPU_LOG`` file
(:mod:`tests.cpu_usage`): ``python scripts/suite_cpu.py log.jsonl [--top 30]
[--before earlier.jsonl]``. Prints the totals (pytest processes, their children, wall)
and the files costing most; with ``--before``, each file's CPU then and now.

A child's CPU counts when it is reaped: a server a module's fixture starts counts at
that module's last test, a session's at the worker's last one."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

Totals = dict[str, list[float]]


def by_file(log: Path) -> tuple[Totals, int]:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    files: Totals = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for row in rows:
        entry = files[row["test"].split("::")[0]]
        entry[0] += row["self_s"]
        entry[1] += row["children_s"]
        entry[2] += row["wall_s"]
        entry[3] += 1
    return files, len(rows)


def totals_line(files: Totals, tests: int) -> str:
    own = sum(e[0] for e in files.values())
    children = sum(e[1] for e in files.values())
    wall = sum(e[2] for e in files.values())
    return (f"{tests} tests in {len(files)} files: CPU {own + children:.0f} s "
            f"(pytest {own:.0f} s, children {children:.0f} s), test wall {wall:.0f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--before", type=Path, default=None)
    args = parser.parse_args()
    files, tests = by_file(args.log)
    ranked = sorted(files.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    if args.before is not None:
        before, before_tests = by_file(args.before)
        print(f"before: {totals_line(before, before_tests)}")
        print(f"after:  {totals_line(files, tests)}")
        print("\n| file | tests before / after | CPU s before | CPU s after |\n|---|---|---|---|")
        for name, (o, c, _, n) in ranked[: args.top]:
            b = before.get(name)
            then = f"{b[0] + b[1]:.1f}" if b else "(new)"
            count = f"{int(b[3]) if b else 0} / {n}"
            print(f"| {name} | {count} | {then} | {o + c:.1f} |")
        return
    print(totals_line(files, tests))
    print("\n| file | tests | CPU s | pytest s | children s | wall s |\n|---|---|---|---|---|---|")
    for name, (o, c, w, n) in ranked[: args.top]:
        print(f"| {name} | {n} | {o + c:.1f} | {o:.1f} | {c:.1f} | {w:.1f} |")


if __name__ == "__main__":
    main()
