"""The benchmarks: figures and ratios measured in one run, never asserted (``coba bench ...``).

    solvers_bench.py  coba bench allocate: the CoBA solvers against a plain Python heap, and at scale
    engines_bench.py  coba bench rollout, verify: rollout backends' tokens/s, verifier items/s
    update_bench.py   coba bench update: the GRPO update against a plain transformers loop (speed, agreement)
    stages_bench.py   coba bench stages: a step's stages against bare vLLM, Prefect's share of a step
    timing.py         timed calls, medians, the machine's CPUs

Each module measures and words its figures (``bench_...``, ``format_...``); the parsers and handlers
are ``coba_tasks.commands.bench_cmd``. Only the commands import this package; ``coba bench stages``
is handed the training flow by its command. Benchmarks that answered a one-time question were
scripts, kept at commit e79713f (their figures are in docs/benchmarks.md).
"""
