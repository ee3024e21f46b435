"""What a held-out evaluation costs, now against before (a one-time question).

A sampled evaluation with a greedy one beside it (``run.eval_samples`` at ``run.eval_temperature`` and
``run.eval_top_p``, plus ``run.eval_greedy``) used to generate and score twice (the sampled completions,
then the greedy ones) with vLLM's own top-p, which sorts the vocabulary of every sequence at every
step. ``evaluation.evaluate`` now submits both to the engine in one call, and the engine finds the nucleus
without the sort (``coba_tasks.engines.rollout.nucleus``). This times, on the same engine, prompts and
seeds, alternated (``--repeats`` each): before (separate calls, vLLM's top-p), one call with vLLM's
top-p, and now (one call, the sort-free top-p); and checks that before and now measure the same (every
prompt's accuracy, greedy accuracy and answered share equal). The sampled evaluation alone is timed
too: what the greedy pass adds.

The figures are in docs/benchmarks.md. This was ``coba bench eval`` until commit c361a60; run it from
the repository root with coba-rl's venv:

    .venv/bin/python scripts/bench_eval.py --config configs/smollm2-arith.yaml
    .venv/bin/python scripts/bench_eval.py --config configs/tiny-test.yaml --set run.eval_samples=4 \\
        --set run.eval_temperature=1.0 --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from coba_tasks.commands.args import positive_int
from coba_tasks.commands.bench_cmd import print_figures, print_progress


def bench_eval(
    config_path: str | None, overrides: Sequence[str] = (), repeats: int = 2, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """The figures (see the module docstring), as a dict; times in seconds."""
    from coba_tasks.engines.rollout import make_backend
    from coba_tasks.pipeline import evaluation
    from coba_tasks.pipeline.config import check_paths, load_config
    from coba_tasks.pipeline.data_run import load_run_datasets
    from coba_tasks.pipeline.run import verifier_pool

    cfg = load_config(config_path, list(overrides))
    check_paths(cfg)
    r = cfg.run
    if r.eval_samples < 2 or r.eval_temperature == 0:
        raise ValueError(
            "bench eval times a sampled evaluation: needs run.eval_samples >= 2 and run.eval_temperature > 0"
        )
    test = load_run_datasets(cfg, train=False).test
    test = evaluation.sample_eval_prompts(test, cfg.data.eval_prompts, r.seed)
    progress(f"engine on {cfg.model.path}; {len(test)} prompts x ({r.eval_samples} sampled + greedy)")
    engine = make_backend(
        cfg.rollout.backend,
        cfg.model.path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.rollout.max_model_len or None,
        seed=r.seed,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    common = {"max_tokens": cfg.rollout.max_tokens, "seed": r.seed, "top_p": r.eval_top_p}
    try:
        with verifier_pool(cfg) as pool:

            def one_call(sort_free: bool = True) -> pd.DataFrame:
                engine.sort_free_top_p = sort_free
                return evaluation.evaluate(
                    test, engine, pool, r.eval_samples, r.eval_temperature, greedy=True, **common
                )

            def separate() -> pd.DataFrame:  # what evaluate did before: each kind apart, vLLM's top-p
                engine.sort_free_top_p = False
                sampled = evaluation.evaluate(test, engine, pool, r.eval_samples, r.eval_temperature, **common)
                greedy = evaluation.evaluate(test, engine, pool, 1, 0.0, **common)
                return sampled.assign(accuracy_greedy=greedy["accuracy"].to_numpy())[one_call_columns]

            def sampled_only() -> pd.DataFrame:
                engine.sort_free_top_p = True
                return evaluation.evaluate(test, engine, pool, r.eval_samples, r.eval_temperature, **common)

            kinds: dict[str, Callable[[], pd.DataFrame]] = {
                "separate": separate,
                "one_call_sort": lambda: one_call(sort_free=False),
                "one_call": one_call,
            }

            progress("warm-up (engine and verifier workers, 4 prompts)")
            one_call_columns = list(
                evaluation.evaluate(
                    test.head(4), engine, pool, r.eval_samples, r.eval_temperature, greedy=True, **common
                )
            )
            kinds["sampled_only"] = sampled_only
            times: dict[str, list[float]] = {name: [] for name in kinds}
            tables: dict[str, pd.DataFrame] = {}
            for i in range(repeats):
                order = list(kinds)[:3] if i % 2 == 0 else list(kinds)[2::-1]
                for name in [*order, "sampled_only"]:
                    progress(f"repeat {i + 1}/{repeats}: {name}")
                    t0 = time.perf_counter()
                    tables[name] = kinds[name]()
                    times[name].append(time.perf_counter() - t0)
    finally:
        engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    same = tables["separate"].reset_index(drop=True).equals(tables["one_call"].reset_index(drop=True))
    return {
        "benchmark": "eval",
        "model": cfg.model.path,
        "prompts": len(test),
        "samples": r.eval_samples,
        "max_tokens": cfg.rollout.max_tokens,
        "seconds": med,
        "runs_s": times,
        "now_over_before": med["one_call"] / med["separate"],
        "sort_free_over_sort": med["one_call"] / med["one_call_sort"],
        "greedy_share_one_call": (med["one_call"] - med["sampled_only"]) / med["one_call"],
        "same_figures": bool(same),
        "accuracy": float(tables["one_call"]["accuracy"].mean()),
        "accuracy_greedy": float(tables["one_call"]["accuracy_greedy"].mean()),
    }


def format_eval(r: dict[str, Any]) -> str:
    s = r["seconds"]
    return "\n".join(
        [
            f"held-out evaluation: {r['model']}, {r['prompts']} prompts x ({r['samples']} sampled + greedy), "
            f"at most {r['max_tokens']} tokens",
            f"  before: separate calls, vLLM's top-p   {s['separate']:7.1f} s",
            f"  one engine call, vLLM's top-p          {s['one_call_sort']:7.1f} s",
            f"  now: one call, sort-free top-p         {s['one_call']:7.1f} s   {r['now_over_before']:.2f}x before, "
            f"{r['sort_free_over_sort']:.2f}x vLLM's top-p",
            f"  now, sampled alone                     {s['sampled_only']:7.1f} s   (the greedy pass adds "
            f"{r['greedy_share_one_call']:.0%} of the evaluation)",
            f"  same figures before and now: {'yes' if r['same_figures'] else 'NO'} (avg@{r['samples']} "
            f"{r['accuracy']:.3f}, greedy {r['accuracy_greedy']:.3f})",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run the benchmark, print its figures (or one JSON line); 0, or 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="scripts/bench_eval.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/smollm2-arith.yaml", help="YAML config (default: the SmolLM2 one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--repeats", type=positive_int, default=2, help="timed evaluations of each kind (default 2)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = parser.parse_args(argv)
    try:
        result = bench_eval(args.config, args.set, args.repeats, progress=print_progress)
    except ValueError as exc:  # bad input: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_figures(result, args.json, format_eval, indent=None)


if __name__ == "__main__":
    sys.exit(main())
