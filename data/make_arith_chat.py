r"""The arithmetic task worded for a chat model: same problems, answers in ``\boxed{}``, scored by math-verify.

Reads ``arith_train.parquet`` and ``arith_test.parquet`` (made by ``make_arith.py``) and writes
``arith_chat_train.parquet`` and ``arith_chat_test.parquet``. Every row keeps its problem, its
``extra_info`` (index, difficulty, split), its ``ability`` and its ground truth; two things change:

- the user message ``36-48+54=`` becomes
  ``Compute 36-48+54. Put your final answer within \boxed{}.``, an instruction an instruct model
  (SmolLM2-135M-Instruct, ``make smollm2``) follows through its chat template;
- ``data_source`` becomes ``"math"``, so ``coba_tasks.engines.verify`` scores the completion with
  math-verify (the last ``\boxed{}``) instead of the ``arith`` verifier (the integer at the start).

The files are written with ``coba_tasks.pipeline.data.write_verl_parquet``: a rerun gives identical bytes.

Run (from the repository root):

    python data/make_arith_chat.py                  # data/arith_chat_train.parquet, data/arith_chat_test.parquet
    python data/make_arith_chat.py --out-dir /tmp/chat
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

try:
    from coba_tasks.pipeline.data import write_verl_parquet
except ModuleNotFoundError:  # a checkout without `pip install -e .`: import from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from coba_tasks.pipeline.data import write_verl_parquet

DATA_DIR = Path(__file__).resolve().parent
DATA_SOURCE = "math"  # scored by math-verify (coba_tasks.engines.verify)
INSTRUCTION = "Compute {expression}. Put your final answer within \\boxed{{}}."
SPLITS = ("train", "test")


def chat_message(content: str) -> str:
    r"""The chat wording of one arithmetic user message.

    >>> chat_message("36-48+54=")
    'Compute 36-48+54. Put your final answer within \\boxed{}.'
    """
    if not content.endswith("=") or len(content) < 2:
        raise ValueError(f"an arithmetic prompt is an expression followed by '=', got {content!r}")
    return INSTRUCTION.format(expression=content[:-1])


def chat_row(row: dict[str, Any]) -> dict[str, Any]:
    """One veRL row of the arithmetic task, reworded; everything but the prompt and data_source is kept."""
    messages = row["prompt"]
    if len(messages) != 1 or messages[0]["role"] != "user":
        raise ValueError(f"row {row['extra_info']}: expected one user message, got {messages}")
    return {
        **row,
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": chat_message(messages[0]["content"])}],
    }


def to_chat(path: str | Path) -> pd.DataFrame:
    """Read an arithmetic veRL file and return its rows in chat wording, in file order."""
    rows = pq.read_table(path).to_pylist()
    return pd.DataFrame([chat_row(row) for row in rows])


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: write arith_chat_train.parquet and arith_chat_test.parquet."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-dir", type=Path, default=DATA_DIR, help="folder of arith_*.parquet (default: data/)")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR, help="output folder (default: data/)")
    args = parser.parse_args(argv)
    for split in SPLITS:
        frame = to_chat(args.in_dir / f"arith_{split}.parquet")
        path = write_verl_parquet(frame, args.out_dir / f"arith_chat_{split}.parquet")
        print(f"wrote {path} ({len(frame)} rows, {path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
