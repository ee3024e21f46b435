r"""The arithmetic task worded for a chat model: same problems, integer answers at the end of the reply.

Reads ``arith_train.parquet`` and ``arith_test.parquet`` (made by ``make_arith.py``) and writes
``arith_chat_train.parquet`` and ``arith_chat_test.parquet``. Every row keeps its problem, its
``extra_info`` (index, difficulty, split), its ``ability`` and its ground truth; two things change:

- the user message ``36-48+54=`` becomes ``Compute 36-48+54. End your reply with the final answer.``,
  an instruction an instruct model (SmolLM2-135M-Instruct, ``make smollm2``) follows through its chat
  template;
- ``data_source`` becomes ``"arith_chat"``, so ``coba_tasks.engines.verify`` scores the last integer
  of the reply that is not an operand ("9 - 7 = 2" gives 2), which is what the prompt asks for,
  instead of the ``arith`` verifier's integer at the start. Not math-verify: it evaluates expressions,
  so the question written back ("9-7") scored as the answer 2, and a model trained on it learned to
  echo the question.

The prompts ask for no answer format the reward does not require: an earlier wording asked for
``\boxed{}``, which the reward did not require, and training taught the model to drop the box (0.11 of
the completions boxed before, 0.00 after).

It writes two training pools for the pre-registered test of allocation (docs/results.md):
``arith_chat_train_l01.parquet`` (the 100 level-0 training problems, then 100 of level 1 drawn by
``tail_pool``) and ``arith_chat_train_l02.parquet`` (the same with level 2, its fallback).

It also writes ``arith_chat_test_reworded.parquet``: the held-out problems again, in the same order,
with the same ids and answers, each worded by one of four other instructions (``REWORDINGS``, chosen
by the problem's index), some with spaces around the operators. A run evaluates it beside
``arith_chat_test.parquet`` (``data.extra_tests``): a gain that shows there too is not a gain on one
wording only.

From the census of docs/results.md ("Where allocation pays, measured per prompt"; its per-problem tables in
``docs/census/``) it writes the positive control's files: ``arith_chat_band_train.parquet`` (24 level-0 training
problems whose answer is not negative, then 24 of the census's unused level-1 problems in its band, each drawn by
``band_pool``) and ``arith_chat_band_test.parquet`` (every held-out problem in the band, ``band_rows``).

The files are written with ``coba_tasks.pipeline.data.write_verl_parquet``: a rerun gives identical bytes.

Run (from the repository root):

    python data/make_arith_chat.py                  # data/arith_chat_*.parquet
    python data/make_arith_chat.py --out-dir /tmp/chat
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

try:
    from coba_tasks.pipeline.data import write_verl_parquet
except ModuleNotFoundError:  # a checkout without `pip install -e .`: import from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from coba_tasks.pipeline.data import write_verl_parquet

DATA_DIR = Path(__file__).resolve().parent
DATA_SOURCE = "arith_chat"  # the last integer of the reply (coba_tasks.engines.verify.arith_chat_verifier)
INSTRUCTION = "Compute {expression}. End your reply with the final answer."
SPLITS = ("train", "test")
TAIL_LEVELS = (1, 2)  # arith_chat_train_l01 / _l02: level 0 and 100 problems of level 1 / 2
TAIL_PER_LEVEL = 100
# other wordings of the same instruction, for a held-out set the training prompts never used
REWORDINGS = (
    "What is {expression}? Give the number last.",
    "Calculate {spaced} and finish with the result.",
    "Evaluate the expression {spaced}. The last thing you write is the number.",
    "Find the value of {expression}, and end with it.",
)


def expression_of(content: str) -> str:
    """The expression of an arithmetic user message (``36-48+54=`` -> ``36-48+54``); ValueError otherwise."""
    if not content.endswith("=") or len(content) < 2:
        raise ValueError(f"an arithmetic prompt is an expression followed by '=', got {content!r}")
    return content[:-1]


def chat_message(content: str) -> str:
    r"""The chat wording of one arithmetic user message.

    >>> chat_message("36-48+54=")
    'Compute 36-48+54. End your reply with the final answer.'
    """
    return INSTRUCTION.format(expression=expression_of(content))


def reworded_message(content: str, index: int) -> str:
    r"""Another wording of one arithmetic user message: ``REWORDINGS[index % 4]``.

    >>> reworded_message("36-48+54=", 0)
    'What is 36-48+54? Give the number last.'
    >>> reworded_message("36-48+54=", 1)
    'Calculate 36 - 48 + 54 and finish with the result.'
    """
    expression = expression_of(content)
    spaced = re.sub(r"(?<=\d)([+*-])", r" \1 ", expression)
    return REWORDINGS[index % len(REWORDINGS)].format(expression=expression, spaced=spaced)


def chat_row(row: dict[str, Any], reworded: bool = False) -> dict[str, Any]:
    """One veRL row of the arithmetic task, reworded; everything but the prompt and data_source is kept."""
    messages = row["prompt"]
    if len(messages) != 1 or messages[0]["role"] != "user":
        raise ValueError(f"row {row['extra_info']}: expected one user message, got {messages}")
    content = messages[0]["content"]
    text = reworded_message(content, int(row["extra_info"]["index"])) if reworded else chat_message(content)
    return {**row, "data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": text}]}


def to_chat(path: str | Path, reworded: bool = False) -> pd.DataFrame:
    """Read an arithmetic veRL file and return its rows in chat wording (or reworded), in file order."""
    rows = pq.read_table(path).to_pylist()
    return pd.DataFrame([chat_row(row, reworded) for row in rows])


def tail_pool(train: pd.DataFrame, hard_level: int, per_level: int = TAIL_PER_LEVEL, seed: int = 0) -> pd.DataFrame:
    """A training pool of an easy level and a hard one, half and half: every level-0 row of ``train`` (in file
    order), then ``per_level`` rows of ``hard_level``: the first of ``numpy.random.default_rng(seed)``'s
    permutation of that level's rows in file order (docs/results.md, the pre-registered pool with a hard tail).

    >>> rows = [{"extra_info": {"difficulty": d, "index": i}} for i, d in enumerate([0, 1, 1, 0, 1, 2])]
    >>> [r["index"] for r in tail_pool(pd.DataFrame(rows), 1, per_level=2)["extra_info"]]
    [0, 3, 4, 1]
    """
    level = train["extra_info"].map(lambda info: int(info["difficulty"]))
    easy, hard = train[level == 0], train[level == hard_level]
    if len(hard) < per_level:
        raise ValueError(f"level {hard_level} has {len(hard)} training rows, fewer than {per_level}")
    picked = hard.iloc[np.random.default_rng(seed).permutation(len(hard))[:per_level]]
    return pd.concat([easy, picked], ignore_index=True)


def unused_rows(
    train: pd.DataFrame, hard_level: int, count: int = TAIL_PER_LEVEL, skip: int = TAIL_PER_LEVEL, seed: int = 0
) -> pd.DataFrame:
    """``count`` rows of ``hard_level`` that ``tail_pool`` (same seed, ``skip`` = its ``per_level``) did not take: the
    next ``count`` of the same permutation (docs/results.md, the census's candidates: problems no run trained on).

    >>> rows = [{"extra_info": {"difficulty": d, "index": i}} for i, d in enumerate([0, 1, 1, 0, 1, 2])]
    >>> [r["index"] for r in tail_pool(pd.DataFrame(rows), 1, per_level=1)["extra_info"]][-1]
    4
    >>> [r["index"] for r in unused_rows(pd.DataFrame(rows), 1, count=2, skip=1)["extra_info"]]
    [1, 2]
    """
    level = train["extra_info"].map(lambda info: int(info["difficulty"]))
    hard = train[level == hard_level]
    if len(hard) < skip + count:
        raise ValueError(f"level {hard_level} has {len(hard)} training rows, fewer than {skip + count}")
    order = np.random.default_rng(seed).permutation(len(hard))
    return hard.iloc[order[skip : skip + count]].reset_index(drop=True)


BAND = (1, 6)  # the census's band: 1 to 6 successes of its 32 completions at checkpoint 4
BAND_PER_HALF = 24  # the positive control's pool: 24 level-0 problems and 24 band problems
BAND_CENSUS = {"unused": "train-l1-unused", "test": ("test-l1", "test-l2")}  # census tables (docs/census/NAME.parquet)


def band_rows(frame: pd.DataFrame, census: pd.DataFrame, band: tuple[int, int] = BAND) -> pd.DataFrame:
    """The rows of ``frame`` (in file order) whose problem the census solved ``band`` times (inclusive); a census
    table's ``prompt_id`` is its problem's ``extra_info`` index.

    >>> frame = pd.DataFrame({"extra_info": [{"index": i} for i in (7, 3, 5)]})
    >>> census = pd.DataFrame({"prompt_id": ["3", "5", "7"], "solved": [2, 0, 6]})
    >>> [r["index"] for r in band_rows(frame, census)["extra_info"]]
    [7, 3]
    """
    solved = census.assign(prompt_id=census["prompt_id"].astype(str)).set_index("prompt_id")["solved"]
    index = frame["extra_info"].map(lambda info: str(info["index"]))
    missing = sorted(set(solved.index) - set(index))
    if missing:
        raise ValueError(f"the census holds problems the file does not: {missing[:5]}")
    counts = index.map(solved)
    return frame[counts.between(*band)].reset_index(drop=True)


def band_pool(train: pd.DataFrame, band: pd.DataFrame, per_half: int = BAND_PER_HALF, seed: int = 0) -> pd.DataFrame:
    """The positive control's pool: ``per_half`` level-0 rows of ``train`` whose answer is not negative (they
    saturate and free budget), then ``per_half`` rows of ``band``, each half the first of
    ``numpy.random.default_rng(seed)``'s permutation of its candidates in file order.

    >>> rows = [{"extra_info": {"difficulty": 0, "index": i}, "reward_model": {"ground_truth": a}}
    ...         for i, a in enumerate(["-1", "3", "0"])]
    >>> band = pd.DataFrame([{"extra_info": {"difficulty": 1, "index": 9}, "reward_model": {"ground_truth": "12"}}])
    >>> [r["index"] for r in band_pool(pd.DataFrame(rows), band, per_half=1)["extra_info"]]
    [1, 9]
    """
    level = train["extra_info"].map(lambda info: int(info["difficulty"]))
    answer = train["reward_model"].map(lambda rm: int(rm["ground_truth"]))
    easy = train[(level == 0) & (answer >= 0)]
    if min(len(easy), len(band)) < per_half:
        raise ValueError(f"{len(easy)} level-0 rows and {len(band)} band rows: fewer than {per_half}")
    picked = [rows.iloc[np.random.default_rng(seed).permutation(len(rows))[:per_half]] for rows in (easy, band)]
    return pd.concat(picked, ignore_index=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: write arith_chat_train.parquet, arith_chat_test.parquet, the reworded test set and the two
    pools with a hard tail (arith_chat_train_l01.parquet, arith_chat_train_l02.parquet)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-dir", type=Path, default=DATA_DIR, help="folder of arith_*.parquet (default: data/)")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR, help="output folder (default: data/)")
    parser.add_argument(
        "--census-dir",
        type=Path,
        default=DATA_DIR.parent / "docs" / "census",
        help="the census's per-problem tables, for the positive control's files (default: docs/census/)",
    )
    args = parser.parse_args(argv)
    train, test = (args.in_dir / f"arith_{split}.parquet" for split in SPLITS)
    outputs = {
        "arith_chat_train": to_chat(train),
        "arith_chat_test": to_chat(test),
        "arith_chat_test_reworded": to_chat(test, reworded=True),
    }
    for hard in TAIL_LEVELS:  # the pools of the pre-registered test: level 0 with level 1 (or 2, its fallback)
        outputs[f"arith_chat_train_l0{hard}"] = tail_pool(outputs["arith_chat_train"], hard)
    # the census's candidates: 100 level-1 training problems that neither pool holds
    outputs["arith_chat_train_l1_unused"] = unused_rows(outputs["arith_chat_train"], 1)
    census = {name: args.census_dir / f"{name}.parquet" for name in (BAND_CENSUS["unused"], *BAND_CENSUS["test"])}
    if all(path.is_file() for path in census.values()):  # the positive control's pool and held-out band problems
        unused = band_rows(outputs["arith_chat_train_l1_unused"], pd.read_parquet(census[BAND_CENSUS["unused"]]))
        outputs["arith_chat_band_train"] = band_pool(outputs["arith_chat_train"], unused)
        tested = pd.concat([pd.read_parquet(census[name]) for name in BAND_CENSUS["test"]], ignore_index=True)
        outputs["arith_chat_band_test"] = band_rows(outputs["arith_chat_test"], tested)
    else:
        print(f"no census tables in {args.census_dir}: the positive control's files are not written")
    for name, frame in outputs.items():
        path = write_verl_parquet(frame, args.out_dir / f"{name}.parquet")
        print(f"wrote {path} ({len(frame)} rows, {path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
