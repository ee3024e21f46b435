"""``coba bench rollout`` and ``coba bench verify``: the engines a stage is built on, each alone.

- rollout: tokens per second of each rollout backend (vLLM, transformers) on the same prompts, group
  sizes and seeds, with the engine's start time beside;
- verify: verifier items per second, the arith verifier in-process and math-verify in worker
  processes (``VerifierPool``), on synthetic items of which a known share is right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from coba_tasks.bench.timing import timed


def bench_rollout(
    model_path: str,
    test_path: str = "data/arith_test.parquet",
    prompts: int = 100,
    group_size: int = 8,
    max_tokens: int = 12,
    backends: tuple[str, ...] = ("vllm", "transformers"),
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """Tokens per second of each rollout backend on the same prompts, group sizes and seeds."""
    from transformers import AutoTokenizer

    from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend, rollout_seed
    from coba_tasks.pipeline.data import load_dataset, render_prompts

    df, _ = render_prompts(load_dataset(test_path).head(prompts), AutoTokenizer.from_pretrained(model_path))
    requests = [
        RolloutRequest(pid, tuple(ids), group_size, rollout_seed(0, 0, pid), prompt=text)
        for pid, ids, text in zip(df["prompt_id"], df["prompt_token_ids"], df["prompt_rendered"], strict=True)
    ]
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
    out: dict[str, Any] = {
        "benchmark": "rollout",
        "model": model_path,
        "prompts": len(requests),
        "group_size": group_size,
        "max_tokens": max_tokens,
        "backends": {},
    }
    for name in backends:
        progress(f"{name}: start engine")
        engine, start_s = timed(make_backend, name, model_path, dtype="float32")
        try:
            engine.generate(requests[:2], sampling)  # warm-up
            progress(f"{name}: generate {len(requests) * group_size} completions")
            rows, gen_s = timed(engine.generate, requests, sampling)
        finally:
            engine.close()
        tokens = sum(r.n_tokens for r in rows)
        out["backends"][name] = {
            "start_s": start_s,
            "generate_s": gen_s,
            "completions": len(rows),
            "tokens": tokens,
            "tokens_per_s": tokens / gen_s,
        }
    if {"vllm", "transformers"} <= set(out["backends"]):
        out["vllm_over_transformers"] = (
            out["backends"]["vllm"]["tokens_per_s"] / out["backends"]["transformers"]["tokens_per_s"]
        )
    return out


def format_rollout(result: dict) -> str:
    """Human-readable report of ``bench_rollout``."""
    lines = [
        f"Rollout benchmark: {result['prompts']} prompts x {result['group_size']} samples, "
        f"max {result['max_tokens']} tokens, temperature 1.0, model {result['model']}",
        f"  {'backend':<14}{'start':>10}{'generate':>11}{'tokens':>9}{'tokens/s':>11}",
    ]
    for name, r in result["backends"].items():
        lines.append(
            f"  {name:<14}{r['start_s']:>9.1f}s{r['generate_s']:>10.2f}s{r['tokens']:>9}{r['tokens_per_s']:>11,.0f}"
        )
    if "vllm_over_transformers" in result:
        lines.append(f"  vLLM / transformers tokens per second: {result['vllm_over_transformers']:.1f}x")
    return "\n".join(lines)


def bench_verify(arith_items: int = 20_000, math_items: int = 300, workers: int = 2, seed: int = 0) -> dict:
    """Verifier items per second: the in-process arith path and math-verify through the worker pool."""
    from coba_tasks.engines.verify import count_verdicts
    from coba_tasks.engines.verify_pool import VerifierPool

    rng = np.random.default_rng(seed)
    a = rng.integers(-999, 999, size=arith_items)
    off = rng.integers(0, 2, size=arith_items)
    arith = [(f"{x + d}", str(x), "arith") for x, d in zip(a.tolist(), off.tolist(), strict=True)]
    templates = [
        (r"so the answer is \boxed{{\frac{{{a}}}{{{b}}}}}", "{a}/{b}"),
        (r"We get $x = {a}$.\nAnswer: {a}", "{a}"),
        (r"\boxed{{{a}\sqrt{{2}}}}", r"\sqrt{{{a2}}}"),
        (r"The result is \boxed{{{a}.5}}", "{a}.5"),
    ]
    maths = []
    for i in range(math_items):
        comp, gold = templates[i % len(templates)]
        x, y = int(rng.integers(1, 50)), int(rng.integers(2, 9))
        wrong = i % 3 == 0
        maths.append((comp.format(a=x + wrong, b=y), gold.format(a=x, b=y, a2=2 * x * x), "math"))
    with VerifierPool(workers=workers, timeout_s=10.0) as pool:
        va, arith_s = timed(pool.score, arith)
        pool.start()
        pool.score(maths[:4])  # warm the workers' caches
        vm, math_s = timed(pool.score, maths)

    def figures(items: int, seconds: float, verdicts: Any) -> dict:
        return {
            "items": items,
            "seconds": seconds,
            "items_per_s": items / seconds,
            "verdicts": count_verdicts(verdicts),
        }

    arith_figures, math_figures = figures(arith_items, arith_s, va), figures(math_items, math_s, vm)
    return {"benchmark": "verify", "workers": workers, "arith": arith_figures, "math": math_figures}


def format_verify(result: dict) -> str:
    """Human-readable report of ``bench_verify``."""
    lines = [f"Verifier benchmark ({result['workers']} worker processes for math-verify)"]
    for name in ("arith", "math"):
        r = result[name]
        lines.append(
            f"  {name:<6}{r['items']:>7} items {r['seconds']:>8.2f} s {r['items_per_s']:>11,.0f} items/s   "
            + ", ".join(f"{k} {v}" for k, v in r["verdicts"].items() if v)
        )
    return "\n".join(lines)
