"""The benchmark's flow: training steps through Prefect interleaved with the same steps as plain calls.

``coba bench stages`` (coba_tasks/bench_stages.py) opens two run directories on one engine and calls
this flow; each flow-side step is ``run_step``, exactly what ``coba-train`` runs per step (five task
runs, the progress line, the step's artifacts), and each plain-side step calls the same task bodies
without Prefect, inside the same flow run, so both sides meet the same server, threads and load.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from coba_tasks.bench_stages import interleave_steps
from flows.train import run_step


@flow(name="coba-bench-steps")
def bench_steps_flow(flow_dir: str, plain_dir: str, steps: int) -> list[dict[str, Any]]:
    """``steps`` steps of each run, alternating which goes first; wall and stage seconds per step and side."""
    return interleave_steps(flow_dir, plain_dir, steps, run_step)
