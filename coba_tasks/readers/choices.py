"""What a reader of a run can be asked for, as plain names (no table library loaded): the choices of
``coba inspect``'s options, which ``coba_tasks.readers.views`` serves."""

from __future__ import annotations

from coba_tasks.pipeline.tables import Table

# The per-step tables, in the order a step produces them (budget first: it is written into the step's directory
# before the step runs; a pilot run's first round before it). ``history`` is the per-step snapshot of the
# pass-rate history, ``eval`` the held-out evaluation (only on evaluated steps).
TABLE_NAMES: tuple[str, ...] = tuple(t.value for t in Table)  # what `coba inspect --stage` shows
FORMATS: tuple[str, ...] = ("table", "csv", "json")
DEFAULT_LIMIT = 20
MECHANISM_VIEWS: tuple[str, ...] = ("steps", "age", "prompts")  # what `coba inspect --mechanisms` shows
