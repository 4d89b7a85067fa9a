"""Superseded by :mod:`benchmarks.freshness`; kept as a thin alias for the old command.

    python -m benchmarks.staleness [--steps 60] [--repeats 1] [--settings 0,1,2]

runs exactly::

    python -m benchmarks.freshness measured --ranks 2 --workers 1 --natural-lengths --warmup 5 \\
        --staleness 0,1,2 --steps 60 --repeats 1

(further options go to ``benchmarks.freshness measured``, e.g. ``--out DIR``), i.e. the old set-up
(``recipes/configs/tiny_cpu.yaml``, 2 gloo ranks, 1 HF worker per rank, the task's natural EOS-terminated
lengths, the first 5 steps left out) with the freshness benchmark's analysis and outputs
(``benchmarks/results/freshness-measured-{date}.json`` and plots). Older results written by this script
itself (``results/staleness-2026-11-30.json``) keep their own schema.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import freshness


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--settings", default="0,1,2", help="max_staleness values")
    args, rest = p.parse_known_args(argv)  # anything else goes to benchmarks.freshness measured (e.g. --out DIR)
    return freshness.main(["measured", "--ranks", "2", "--workers", "1", "--natural-lengths", "--warmup", "5",
                           "--staleness", args.settings, "--steps", str(args.steps), "--repeats", str(args.repeats),
                           *rest])


if __name__ == "__main__":
    sys.exit(main())
