"""The benchmark's flow: training steps through Prefect interleaved with the same steps as plain calls.

``coba bench stages`` (``coba_tasks.bench.stages_bench``) opens two run directories on one engine and
calls this flow; each flow-side step is ``run_step``, exactly what ``coba-train`` runs per step (five
task runs, the progress line, the step's artifacts), and each plain-side step runs the same stage
functions without Prefect (``coba_tasks.pipeline.stages.plain_step``), inside the same flow run, so both sides
meet the same server, threads and load.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from coba_tasks.pipeline import run
from coba_tasks.pipeline.stages import plain_step
from coba_tasks.pipeline.store import STAGES
from flows.train import run_step


@flow(name="coba-bench-steps")
def bench_steps_flow(flow_dir: str, plain_dir: str, steps: int) -> list[dict[str, Any]]:
    """Steps 0..steps-1 of two runs that share one engine, alternating which goes first.

    Before the second run of each pair the engine is given the weights of step t again (untimed). Per
    step and side: the wall time, the seconds inside the stage bodies, and the seconds per stage
    (timing.json).
    """
    sides = {"flow": (flow_dir, run_step), "plain": (plain_dir, plain_step)}
    pairs = []
    for t in range(steps):
        order = ("flow", "plain") if t % 2 == 0 else ("plain", "flow")
        pair: dict[str, Any] = {"step": t, "first": order[0]}
        for i, side in enumerate(order):
            run_dir, step_fn = sides[side]
            res = run.resources(run_dir)
            if i == 1:  # the first run's update loaded its step t + 1 weights: back to step t
                ckpt = res.store.checkpoint_dir(t) if t > 0 else res.cfg.model.path
                res.engine.load_weights(ckpt, version=t)
            inside0 = sum(res.stage_seconds.values())
            t0 = time.perf_counter()
            step_fn(run_dir, t)
            wall = time.perf_counter() - t0
            timing = res.store.read_json(f"steps/{t:06d}/timing.json")
            pair[side] = {
                "wall_s": wall,
                "inside_s": sum(res.stage_seconds.values()) - inside0,
                "stage_s": {str(name): float(timing[name]) for name in STAGES},
            }
        pairs.append(pair)
    return pairs
