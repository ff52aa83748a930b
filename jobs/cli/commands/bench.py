"""``slotq bench``: the benchmarks in the checkout's bench/ package.

bench/ is not in the wheel (producers don't need it), so ``slotq bench`` runs from a checkout and
reaches bench/ by putting the checkout on ``sys.path`` (:func:`_checkout_benchmarks`), in this module
only, and only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

# the options of one benchmark only, passed to its run() as keyword arguments
BENCH_OPTIONS = {"spec": ("concurrency", "rounds", "draft_model"), "fleet": ("cluster", "models", "partitions")}


def cmd_bench(args: argparse.Namespace) -> None:
    options = {name: getattr(args, name) for names in BENCH_OPTIONS.values() for name in names
               if getattr(args, name) is not None}
    for which, names in BENCH_OPTIONS.items():
        foreign = [name for name in names if name in options and args.which != which]
        if foreign:
            flags = ", ".join("--" + name.replace("_", "-") for name in foreign)
            raise SystemExit(f"slotq bench {args.which}: {flags} apply to `slotq bench {which}` only")
    if args.draft_model is not None and not args.draft_model.is_file():
        raise SystemExit(f"slotq bench spec: --draft-model: no such file: {args.draft_model}")
    run_benchmark = _checkout_benchmarks()
    run_benchmark(args.which, as_json=args.json == "-", quick=args.quick,
                  json_path=Path(args.json) if args.json not in (None, "-") else None, options=options)


def client_counts(text: str) -> list[int]:
    """``--concurrency 1,4,16``: positive client counts."""
    return _positive_counts(text, "client counts", "1,4,16")


def primary_counts(text: str) -> list[int]:
    """``--cluster 1,3,6``: numbers of cluster primaries."""
    return _positive_counts(text, "numbers of primaries", "1,3,6")


def _positive_counts(text: str, what: str, example: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} such as {example}, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be >= 1, got {text!r}")
    return counts


def _checkout_benchmarks() -> Callable[..., object]:
    """The checkout's ``bench.run_benchmark``: an editable install (``make install``) maps ``slotq.jobs``
    to the checkout's jobs/, next to bench/, which goes on ``sys.path`` for the import."""
    import slotq.jobs

    checkout = Path(slotq.jobs.__file__).resolve().parents[1]
    if not (checkout / "bench" / "__init__.py").is_file():
        raise SystemExit("slotq bench: the benchmarks are not installed with slotq; run them from a checkout of the "
                         "slotq repository (git clone, then `make bench` or `.venv/bin/slotq bench ...` there)")
    if str(checkout) not in sys.path:
        sys.path.append(str(checkout))
    from bench import run_benchmark

    return run_benchmark
