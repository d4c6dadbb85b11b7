"""Run every benchmark: `python -m benchmarks [name ...]`."""

from __future__ import annotations

import sys

from benchmarks import journal_specs

BENCHMARKS = {"journal-specs": journal_specs.main}


def main(argv: list[str]) -> None:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; have {', '.join(BENCHMARKS)}")
    for name in names:
        BENCHMARKS[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
