"""``coba bench``: the benchmark group, and the parsers and handlers of ``allocate``, ``rollout``, ``verify``.

    coba bench allocate [--json]
    coba bench rollout  [--json]
    coba bench verify   [--json]

The measurements are in ``coba_tasks.commands.bench``. The other benchmarks (``update``, ``stages``,
``eval``, ``lora``) declare their own subcommands in their modules (``COMMAND``); ``add_bench_parser``
registers the group, these three, then those.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from coba_tasks.commands.args import add_command, option, positive_int

JSON_OPTION = option("--json", action="store_true", help="print the figures as JSON")


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``coba bench`` and every benchmark under it; returns the group's parser."""
    from coba_tasks.commands import bench_eval, bench_lora, bench_stages, bench_update

    bench = add_command(
        subparsers,
        "bench",
        help="benchmarks (print figures measured in one run)",
        description="Benchmarks. They print figures and ratios measured in one run; they assert nothing.",
        examples=["coba bench allocate", "coba bench allocate --json"],
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench_sub.required = True

    add_command(
        bench_sub,
        "allocate",
        help="heap vs threshold vs DP allocation, and a scale sweep",
        description="Time the CoBA solvers at the paper's Table 4 setting (M = 512, B_total = 8192, bounds "
        "[2, 128]) against a plain Python heap, then sweep M over 512, 4096, 65536 and 1,000,000 "
        "(B_total = 16 M). The heap and the DP run where their time, predicted from the last size measured, "
        "is under 60 s.",
        examples=["coba bench allocate", "coba bench allocate --quick --json"],
        options=[
            JSON_OPTION,
            option("--quick", action="store_true", help="fewer repeats, sweep only to M = 65536"),
            option("--seed", type=int, default=0, help="seed of the random pass rates (default 0)"),
        ],
        func=cmd_bench_allocate,
    )
    add_command(
        bench_sub,
        "rollout",
        help="tokens per second of the vLLM and transformers rollout backends",
        description="Generate the same prompts, group sizes and seeds with each backend and print tokens per second.",
        examples=["coba bench rollout", "coba bench rollout --backends vllm --prompts 200 --n 16"],
        options=[
            option("--model", default="models/arith-tiny", help="HF model directory (default models/arith-tiny)"),
            option("--test", default="data/arith_test.parquet", help="prompts to use (veRL Parquet)"),
            option("--prompts", type=positive_int, default=100, help="number of prompts (default 100)"),
            option("--n", type=positive_int, default=8, help="samples per prompt (default 8)"),
            option("--max-tokens", type=positive_int, default=12, help="max new tokens (default 12)"),
            option("--backends", default="vllm,transformers", help="comma-separated (default vllm,transformers)"),
            JSON_OPTION,
        ],
        func=cmd_bench_rollout,
    )
    add_command(
        bench_sub,
        "verify",
        help="verifier items per second (arith in-process, math-verify in worker processes)",
        description="Score synthetic arith and math items through the verifier pool and print items per second.",
        examples=["coba bench verify", "coba bench verify --math 1000 --workers 2 --json"],
        options=[
            option("--arith", type=positive_int, default=20_000, help="arith items (default 20000)"),
            option("--math", type=positive_int, default=300, help="math items (default 300)"),
            option("--workers", type=positive_int, default=2, help="worker processes (default 2)"),
            JSON_OPTION,
        ],
        func=cmd_bench_verify,
    )
    for module in (bench_update, bench_stages, bench_eval, bench_lora):
        module.COMMAND.add_to(bench_sub)
    return bench


def cmd_bench_allocate(args: argparse.Namespace) -> int:
    """Run ``coba bench allocate``: progress on stderr, the figures (text or JSON) on stdout."""
    from coba_tasks.commands.bench import bench_allocate, format_allocate, print_figures, print_progress

    result = bench_allocate(seed=args.seed, quick=args.quick, progress=print_progress)
    return print_figures(result, args.json, format_allocate)


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    """Run ``coba bench rollout`` on --model (which must exist)."""
    from coba_tasks.commands.bench import bench_rollout, format_rollout, print_figures, print_progress

    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"model {args.model} not found: run `coba bootstrap` first or pass --model DIR")
    result = bench_rollout(
        args.model,
        args.test,
        prompts=args.prompts,
        group_size=args.n,
        max_tokens=args.max_tokens,
        backends=tuple(args.backends.split(",")),
        progress=print_progress,
    )
    return print_figures(result, args.json, format_rollout)


def cmd_bench_verify(args: argparse.Namespace) -> int:
    """Run ``coba bench verify``."""
    from coba_tasks.commands.bench import bench_verify, format_verify, print_figures

    result = bench_verify(arith_items=args.arith, math_items=args.math, workers=args.workers)
    return print_figures(result, args.json, format_verify)
