"""The benchmarks: figures and ratios measured in one run, never asserted (``coba bench ...``).

Each module measures and words its figures (``bench_...``, ``format_...``); the parsers and handlers
are ``coba_tasks.commands.bench_cmd``. Only the commands import this package; ``coba bench stages``
is handed the training flow by its command. Benchmarks that answered a one-time question were
scripts, kept at commit e79713f (their figures are in docs/benchmarks.md).
"""
