"""Prefect flows of coba-rl: they compose the tasks in coba_tasks, in stage order, and nothing else.

The training flow (rollout -> verification -> failure-rate update -> allocation -> GRPO update per
step) and the bootstrap flow live here; see DESIGN.md in the README's design section.
"""
