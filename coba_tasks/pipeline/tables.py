"""The names of a run's per-step tables and the order a step writes them: plain names, no I/O, so that what
only needs a name (the command line's choices, a reader's column of table names) does not load the store's
libraries. ``coba_tasks.pipeline.store`` reads and writes the tables.
"""

from __future__ import annotations

from enum import StrEnum


class Table(StrEnum):
    """The tables of ``steps/t``, each named by its file: the first nine are the stages' (in the order
    ``SAMPLING_STAGES`` gives; each run's steps have those ``step_stages`` names), ``history`` the capability
    stage's second, ``eval`` the held-out evaluation of the weights after t updates (computed before step t starts).
    ``round`` and ``round_rewards`` hold every round so far of a step sampled in rounds (a ``round`` column), each
    written again as a round is added.

    >>> [t.value for t in Table]
    ['pilot', 'pilot_rewards', 'budget', 'round', 'round_rewards', 'rollouts', 'rewards', 'capability', 'update', \
'history', 'eval']
    >>> [t.value for t in step_stages("once")]
    ['budget', 'rollouts', 'rewards', 'capability', 'update']
    """

    PILOT = "pilot"
    PILOT_REWARDS = "pilot_rewards"
    BUDGET = "budget"
    ROUND = "round"
    ROUND_REWARDS = "round_rewards"
    ROLLOUTS = "rollouts"
    REWARDS = "rewards"
    CAPABILITY = "capability"
    UPDATE = "update"
    HISTORY = "history"
    EVAL = "eval"


# One training step, in order: the one place the stage order is written. Every step allocates its budget, samples
# and scores its rollouts, updates the capability and the policy. Under the pilot estimator a pilot and its rewards
# lead (the budget is allocated after them); a strategy that samples in rounds (dynamic, ada) samples and scores
# one round at a time (``round``, ``round_rewards``, again while it asks for another round), then writes the
# step's rollouts and rewards from its rounds (docs/design.md, "One training step, stage by stage").
STAGES = (Table.BUDGET, Table.ROLLOUTS, Table.REWARDS, Table.CAPABILITY, Table.UPDATE)
PILOT_STAGES = (Table.PILOT, Table.PILOT_REWARDS, *STAGES)
ROUND_STAGES = (Table.BUDGET, Table.ROUND, Table.ROUND_REWARDS, *STAGES[1:])
ROUND_PAIR = (Table.ROUND, Table.ROUND_REWARDS)  # what repeats, a round at a time
SAMPLING_STAGES = {"once": STAGES, "pilot": PILOT_STAGES, "rounds": ROUND_STAGES}
STEP_ORDER = (Table.PILOT, Table.PILOT_REWARDS, *ROUND_STAGES)  # every stage's table in the order a step writes them


def step_stages(sampling: str) -> tuple[Table, ...]:
    """The stages of one training step in the order they run, by how it samples (``AllocationConfig.sampling``:
    ``once``, ``pilot``, ``rounds``)."""
    return SAMPLING_STAGES[sampling]


# Stages a user can rerun (``coba rerun --stage``), by the file they own in steps/<step>/.
RERUNNABLE = (*STEP_ORDER, Table.EVAL)
