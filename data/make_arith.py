"""Generate the synthetic arithmetic task: integer expressions in five graded difficulty levels.

The default dataset of coba-rl (docs/design.md). A tiny character-level model,
warmed up by supervised training on the train split, should solve level 0 almost always, part of
the middle levels and almost none of level 4: that spread of pass rates is what rollout-budget
allocation works on. Problems are short (at most 13 characters) and every answer is an integer.

    level 0  two one-digit operands, + or -                                   4-6=           -2
    level 1  a two-digit and a one-digit operand: a+b, b+a or a-b             68+4=          72
    level 2  two two-digit operands, + or -                                   46-90=         -44
    level 3  three two-digit operands, + and -                                36-48+54=      42
    level 4  two three-digit numbers and a product (2-9 times two digits)     786+8*50+352=  1538

Products bind tighter than + and -, as usual. Rows are in veRL layout: the user message is the
expression followed by '=', the ground truth is the integer as a string, ``data_source`` is
"arith", ``extra_info`` is ``{index, difficulty, split}``.

Determinism: level L draws from ``numpy.random.default_rng([seed, L])``, test problems first, so
the test split depends only on the seed and ``--test-size``. No expression appears twice, within or
across splits. The same arguments give byte-identical files.

Run (from the repository root):

    python data/make_arith.py                      # data/arith_train.parquet, data/arith_test.parquet
    python data/make_arith.py --seed 1 --out-dir /tmp/arith --train-size 5000
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

try:
    from coba_tasks.pipeline.data import write_verl_parquet
except ModuleNotFoundError:  # a checkout without `pip install -e .`: import from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from coba_tasks.pipeline.data import write_verl_parquet

DATA_SOURCE = "arith"
ABILITY = "arithmetic"
SHUFFLE_STREAM = 1_000  # rng stream for the train order, apart from the level streams 0..4
MAX_REPEATS = 10_000  # consecutive repeated draws after which a level counts as exhausted

Term = tuple[int, ...]  # the factors of one product; a plain number is a 1-tuple


@dataclass(frozen=True)
class Expression:
    """terms[0] ops[0] terms[1] ops[1] ... with ops in {'+', '-'} and each term a product."""

    terms: tuple[Term, ...]
    ops: tuple[str, ...]

    def text(self) -> str:
        """The expression as written, without spaces: ``37+58-12``."""
        words = ["*".join(map(str, self.terms[0]))]
        for op, term in zip(self.ops, self.terms[1:], strict=True):
            words += [op, "*".join(map(str, term))]
        return "".join(words)

    def value(self) -> int:
        """The exact integer value (products first, then + and - from left to right)."""
        total = math.prod(self.terms[0])
        for op, term in zip(self.ops, self.terms[1:], strict=True):
            total += math.prod(term) if op == "+" else -math.prod(term)
        return total


# ---------------------------------------------------------------------------------------------
# Levels: one sampler each, from easiest to hardest


def _number(rng: np.random.Generator, digits: int) -> int:
    """A uniform integer with exactly ``digits`` digits (one digit: 0..9)."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


def _ops(rng: np.random.Generator, n: int) -> tuple[str, ...]:
    return tuple(str(op) for op in rng.choice(["+", "-"], size=n))


def _level0(rng: np.random.Generator) -> Expression:
    """Two one-digit operands, + or - (200 problems in all)."""
    return Expression(((_number(rng, 1),), (_number(rng, 1),)), _ops(rng, 1))


def _level1(rng: np.random.Generator) -> Expression:
    """A two-digit and a one-digit operand: a+b either way round, or a-b >= 0 (2,700 problems in all)."""
    big, small = _number(rng, 2), _number(rng, 1)
    if rng.random() < 2 / 3:
        terms = ((big,), (small,)) if rng.random() < 0.5 else ((small,), (big,))
        return Expression(terms, ("+",))
    return Expression(((big,), (small,)), ("-",))


def _level2(rng: np.random.Generator) -> Expression:
    """Two two-digit operands, + or - (the result may be negative)."""
    return Expression(((_number(rng, 2),), (_number(rng, 2),)), _ops(rng, 1))


def _level3(rng: np.random.Generator) -> Expression:
    """Three two-digit operands with + and -."""
    return Expression(tuple((_number(rng, 2),) for _ in range(3)), _ops(rng, 2))


def _level4(rng: np.random.Generator) -> Expression:
    """Three terms: two three-digit numbers and one product of a one-digit (2-9) and a two-digit number."""
    terms: list[Term] = [(_number(rng, 3),), (_number(rng, 3),)]
    terms.insert(int(rng.integers(0, 3)), (int(rng.integers(2, 10)), _number(rng, 2)))
    return Expression(tuple(terms), _ops(rng, 2))


@dataclass(frozen=True)
class Level:
    """A difficulty level: how to draw one problem, and the level's share of the train split."""

    sample: Callable[[np.random.Generator], Expression]
    train_share: float


# Levels 0 and 1 have few distinct problems (200 and 2,700), so they get small shares; a level that
# runs out of new problems passes the rest of its share on to the next level.
LEVELS = (
    Level(_level0, 0.005),
    Level(_level1, 0.125),
    Level(_level2, 0.29),
    Level(_level3, 0.29),
    Level(_level4, 0.29),
)


# ---------------------------------------------------------------------------------------------
# Splits


def split_counts(total: int, shares: Sequence[float]) -> list[int]:
    """Integer counts proportional to ``shares`` that sum to ``total`` (largest remainders first).

    >>> split_counts(500, [0.2] * 5)
    [100, 100, 100, 100, 100]
    >>> split_counts(7, [0.2] * 5)
    [2, 2, 1, 1, 1]
    """
    exact = [total * s / sum(shares) for s in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _draw_unique(
    sample: Callable[[np.random.Generator], Expression], rng: np.random.Generator, n: int, seen: set[str]
) -> list[Expression]:
    """Up to ``n`` expressions whose text is not in ``seen`` (which is updated).

    Fewer come back only when the level has run out of new problems (``MAX_REPEATS`` draws in a
    row gave nothing new).
    """
    drawn: list[Expression] = []
    repeats = 0
    while len(drawn) < n and repeats < MAX_REPEATS:
        expr = sample(rng)
        if expr.text() in seen:
            repeats += 1
            continue
        seen.add(expr.text())
        drawn.append(expr)
        repeats = 0
    return drawn


def _rows(exprs: Sequence[tuple[int, Expression]], split: str, first_index: int) -> pd.DataFrame:
    """(level, expression) pairs -> veRL rows with consecutive ``extra_info.index`` from ``first_index``."""
    return pd.DataFrame(
        {
            "data_source": DATA_SOURCE,
            "prompt": [[{"role": "user", "content": f"{e.text()}="}] for _, e in exprs],
            "ability": ABILITY,
            "reward_model": [{"style": "rule", "ground_truth": str(e.value())} for _, e in exprs],
            "extra_info": [
                {"index": first_index + k, "difficulty": level, "split": split} for k, (level, _) in enumerate(exprs)
            ],
        }
    )


def make_splits(seed: int = 0, train_size: int = 20_000, test_size: int = 500) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The train and test splits in veRL layout.

    Test holds ``test_size`` problems spread evenly over the levels, ordered by level, with
    indices 0..test_size-1; train holds ``train_size`` problems shared by ``Level.train_share``
    (a level that runs out passes the rest on to the next), in a seeded random order, with the
    indices that follow. No expression is repeated anywhere.

    Raises:
        ValueError: the levels have too few distinct problems for the sizes asked.
    """
    if train_size < 0 or test_size < 0:
        raise ValueError(f"sizes must be >= 0, got train_size={train_size}, test_size={test_size}")
    seen: set[str] = set()
    test: list[tuple[int, Expression]] = []
    train: list[tuple[int, Expression]] = []
    test_counts = split_counts(test_size, [1.0] * len(LEVELS))
    train_counts = split_counts(train_size, [level.train_share for level in LEVELS])
    carried = 0  # train problems that earlier levels could not supply
    for number, level in enumerate(LEVELS):
        rng = np.random.default_rng([seed, number])
        test_exprs = _draw_unique(level.sample, rng, test_counts[number], seen)
        if len(test_exprs) < test_counts[number]:
            found = len(test_exprs)
            raise ValueError(f"level {number} has only {found} distinct problems; ask for a smaller test split")
        train_exprs = _draw_unique(level.sample, rng, train_counts[number] + carried, seen)
        carried = train_counts[number] + carried - len(train_exprs)
        test += [(number, e) for e in test_exprs]
        train += [(number, e) for e in train_exprs]
    if carried:
        raise ValueError(f"the levels ran out of distinct problems {carried} short; ask for a smaller train split")
    order = np.random.default_rng([seed, SHUFFLE_STREAM]).permutation(len(train))
    train = [train[i] for i in order]
    return _rows(train, "train", first_index=test_size), _rows(test, "test", first_index=0)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: write arith_train.parquet and arith_test.parquet."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0, the shipped files)")
    parser.add_argument(
        "--out-dir", type=Path, default=Path(__file__).resolve().parent, help="output folder (default: data/)"
    )
    parser.add_argument("--train-size", type=int, default=20_000, help="train problems (default: 20000)")
    parser.add_argument("--test-size", type=int, default=500, help="test problems, even over levels (default: 500)")
    args = parser.parse_args(argv)
    train, test = make_splits(args.seed, args.train_size, args.test_size)
    for name, frame in (("arith_train", train), ("arith_test", test)):
        path = write_verl_parquet(frame, args.out_dir / f"{name}.parquet")
        print(f"wrote {path} ({len(frame)} rows, {path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
