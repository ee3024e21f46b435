"""The verifier pool (coba_tasks.engines.verify_pool) against pebble's ProcessPool, the maintained library made for
process pools with a limit per item: the reasons, measured, that the project keeps its own (docs/benchmarks.md,
"The verifier pool and pebble"). pebble is not a dependency: install it beside the project's first.

    .venv/bin/pip install pebble==5.1.3 && .venv/bin/python scripts/verifier_pool_vs_pebble.py

1. The same 2,000 math-verify items (and 2 of them that run for ever), 2 workers, 5 s a item: seconds each and
   whether the verdicts are the same.
2. A reward file whose top-level code runs too long: pebble's limit covers a task, not a worker's initializer (where
   the file is imported), so the batch waits without end; the pool stops it in verify.timeout_s, in one line.
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing import get_context

from pebble import ProcessPool

from coba_tasks.engines.verify import score
from coba_tasks.engines.verify_pool import VerifierPool


def one(item: tuple[str, str, str]) -> tuple[float, str]:
    v = score(*item)
    return v.reward, str(v.verdict)


def items(n: int, stuck: int = 0) -> list[tuple[str, str, str]]:
    base = [(f"so the answer is \\boxed{{{i % 97}}}", str(i % 89), "math") for i in range(n)]
    return base[: n - stuck] + [("\\boxed{9^{9^{9^{9}}}}", "5", "math")] * stuck


def with_pebble(pool: ProcessPool, batch: list[tuple[str, str, str]], timeout: float) -> list[tuple[float, str]]:
    futures = [pool.schedule(one, args=(it,), timeout=timeout) for it in batch]
    out = []
    for f in futures:
        try:
            out.append(f.result())
        except FutureTimeout:
            out.append((0.0, "timeout"))
    return out


def slow_import() -> None:
    time.sleep(30)  # a reward file's top-level code that runs too long


def echo(x: int) -> int:
    return x


def main() -> None:
    for n, stuck in ((2000, 0), (2000, 2)):
        batch = items(n, stuck)
        with VerifierPool(workers=2, timeout_s=5.0) as ours:
            ours.score(batch[:4])  # started and warm
            t0 = time.perf_counter()
            a = [(v.reward, str(v.verdict)) for v in ours.score(batch)]
            t_ours = time.perf_counter() - t0
        with ProcessPool(max_workers=2, context=get_context("spawn")) as pool:
            with_pebble(pool, batch[:4], 60)  # started and warm
            t0 = time.perf_counter()
            b = with_pebble(pool, batch, 5.0)
            t_pebble = time.perf_counter() - t0
        print(
            f"{n} items, {stuck} that run for ever: pool {t_ours:.2f} s, pebble {t_pebble:.2f} s "
            f"(pebble/pool {t_pebble / t_ours:.2f}x); same verdicts: {a == b}"
        )
    with ProcessPool(max_workers=1, initializer=slow_import, context=get_context("spawn")) as pool:
        t0 = time.perf_counter()
        future = pool.schedule(echo, args=(1,), timeout=2.0)
        try:
            future.result(timeout=12)
            print(f"pebble, an initializer of 30 s, a task limit of 2 s: answered in {time.perf_counter() - t0:.1f} s")
        except FutureTimeout:
            print(
                "pebble, an initializer of 30 s, a task limit of 2 s: neither a result nor the task's timeout "
                f"after {time.perf_counter() - t0:.1f} s"
            )
        pool.stop()


if __name__ == "__main__":
    main()
