"""Prefect flows of coba-rl: they compose the tasks in coba_tasks, in stage order, and nothing else.

The training flow `coba-train` (rollout -> verification -> failure-rate update -> allocation -> GRPO
update per step), the bootstrap flow `coba-bootstrap` and the held-out evaluation flow `coba-eval`
live here; prefect.yaml deploys all three (docs/workers.md).
"""
