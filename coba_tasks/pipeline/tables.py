"""The names of a run's per-step tables and the order a step writes them: plain names, no I/O, so that what
only needs a name (the command line's choices, a reader's column of table names) does not load the store's
libraries. ``coba_tasks.pipeline.store`` reads and writes the tables.
"""

from __future__ import annotations

from enum import StrEnum


class Table(StrEnum):
    """The tables of ``steps/t``, each named by its file: the first seven are the stages' (in the order
    ``SAMPLING_STAGES`` gives; each run's steps have those ``step_stages`` names), ``history`` the capability
    stage's second, ``eval`` the held-out evaluation of the weights after t updates (computed before step t starts).
    ``round`` and ``round_rewards`` hold every round so far of a step sampled in rounds (a ``round`` column), each
    written again as a round is added.

    >>> [t.value for t in Table]
    ['budget', 'round', 'round_rewards', 'rollouts', 'rewards', 'capability', 'update', 'history', 'eval']
    >>> [t.value for t in step_stages("once")]
    ['budget', 'rollouts', 'rewards', 'capability', 'update']
    >>> [t.value for t in step_stages("pilot")]
    ['round', 'round_rewards', 'budget', 'rollouts', 'rewards', 'capability', 'update']
    """

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
# and scores its rollouts, updates the capability and the policy. A step sampled in rounds samples and scores one
# round at a time (``round``, ``round_rewards``, again while its rule asks for another round: the rounds are
# decided from the rewards of the rounds before them), then writes the step's rollouts and rewards from its rounds.
# Its rules: dynamic and ada allocate their first round (``budget``), then sample their rounds; the pilot estimator
# samples its pilot (round 0), allocates the step's budget on it, then samples the rest of each budget (round 1,
# given right after the budget: ``stages.step_tasks``). docs/design.md, "One training step, stage by stage".
STAGES = (Table.BUDGET, Table.ROLLOUTS, Table.REWARDS, Table.CAPABILITY, Table.UPDATE)
ROUND_STAGES = (Table.BUDGET, Table.ROUND, Table.ROUND_REWARDS, *STAGES[1:])
PILOT_STAGES = (Table.ROUND, Table.ROUND_REWARDS, *STAGES)
ROUND_PAIR = (Table.ROUND, Table.ROUND_REWARDS)  # what repeats, a round at a time
SAMPLING_STAGES = {"once": STAGES, "pilot": PILOT_STAGES, "rounds": ROUND_STAGES}
STEP_ORDER = ROUND_STAGES  # every stage's table, in the order a rerun removes them (the pilot's budget: its rounds')


def step_stages(sampling: str) -> tuple[Table, ...]:
    """The stages of one training step in the order they run, by how it samples (``AllocationConfig.sampling``:
    ``once``, ``pilot``, ``rounds``)."""
    return SAMPLING_STAGES[sampling]


# Stages a user can rerun (``coba rerun --stage``), by the file they own in steps/<step>/.
RERUNNABLE = (*STEP_ORDER, Table.EVAL)


def step_label(step: int, steps: int, at_most: bool = False) -> str:
    """A step as every message names it: its number, the one of ``steps/<step>/``, its tasks (``rollouts-step-2``)
    and ``--step``, counted from 0, then how far into the run it is (``at_most``: the run may end sooner, under
    ``run.rollout_budget``).

    >>> step_label(2, 10), step_label(0, 40, at_most=True)
    ('step 2 (3 of 10)', 'step 0 (1 of at most 40)')
    """
    return f"step {step} ({step + 1} of {'at most ' if at_most else ''}{steps})"


def after_updates(version: int) -> str:
    """The policy a held-out evaluation or checkpoint holds, by the updates behind it (``steps/<version>/eval``).

    >>> after_updates(1), after_updates(0)
    ('after 1 update', 'after 0 updates')
    """
    return f"after {version} update{'' if version == 1 else 's'}"
