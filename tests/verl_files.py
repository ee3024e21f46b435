"""Parquet files in the shapes veRL's own data preprocessing writes (its GSM8K and MATH examples).

veRL maps each example to ``data_source``, ``prompt`` (a list of one ``{role, content}`` user message: the
question, a space, and an instruction), ``ability`` ("math"), ``reward_model`` (``{style: "rule",
ground_truth}``) and ``extra_info``, and writes the table with Hugging Face ``datasets``: nested structs
and a list of structs, 64-bit integers, and the ``huggingface`` schema metadata. The columns the map pops
(GSM8K's ``question`` and ``answer``, MATH's ``problem`` and ``solution``) are gone; the others of the
source stay (MATH-lighteval's ``level`` and ``type``, written first). These writers build such tables with
pyarrow directly, type for type, so the tests need neither ``datasets`` nor a download.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval")

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
GSM8K_EXTRA = pa.struct(
    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
)
MATH_EXTRA = pa.struct([("split", pa.string()), ("index", pa.int64())])


def _hf_metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    """The ``huggingface`` key ``datasets`` writes into the schema (its features, roughly)."""
    features = {f.name: str(f.type) for f in schema}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def _write(path: Path, columns: dict[str, pa.Array]) -> Path:
    table = pa.table(columns)
    pq.write_table(table.replace_schema_metadata(_hf_metadata(table.schema)), path)
    return path


def write_verl_gsm8k(path: Path, items: Sequence[tuple[str, str]], split: str = "train") -> Path:
    """A veRL GSM8K file: one row per ``(question, answer number)``; ``extra_info.answer`` is the
    dataset's worked answer, ending in ``#### <number>`` as GSM8K's do."""
    answers = [f"Work it out.\n#### {a}" for _, a in items]
    return _write(
        path,
        {
            "data_source": pa.array([GSM8K_SOURCE] * len(items), pa.string()),
            "prompt": pa.array(
                [[{"role": "user", "content": f"{q} {GSM8K_INSTRUCTION}"}] for q, _ in items], pa.list_(MESSAGE)
            ),
            "ability": pa.array(["math"] * len(items), pa.string()),
            "reward_model": pa.array([{"style": "rule", "ground_truth": a} for _, a in items], REWARD_MODEL),
            "extra_info": pa.array(
                [
                    {"split": split, "index": i, "answer": full, "question": q}
                    for i, ((q, _), full) in enumerate(zip(items, answers, strict=True))
                ],
                GSM8K_EXTRA,
            ),
        },
    )


def write_verl_math(
    path: Path, items: Sequence[tuple[str, str]], source: str = MATH_SOURCES[1], split: str = "train"
) -> Path:
    """A veRL MATH file: one row per ``(problem, ground truth)``, with MATH-lighteval's ``level`` and
    ``type`` columns left in front as veRL's script leaves them."""
    n = len(items)
    return _write(
        path,
        {
            "level": pa.array([f"Level {1 + i % 5}" for i in range(n)], pa.string()),
            "type": pa.array(["Algebra"] * n, pa.string()),
            "data_source": pa.array([source] * n, pa.string()),
            "prompt": pa.array(
                [[{"role": "user", "content": f"{q} {MATH_INSTRUCTION}"}] for q, _ in items], pa.list_(MESSAGE)
            ),
            "ability": pa.array(["math"] * n, pa.string()),
            "reward_model": pa.array([{"style": "rule", "ground_truth": a} for _, a in items], REWARD_MODEL),
            "extra_info": pa.array([{"split": split, "index": i} for i in range(n)], MATH_EXTRA),
        },
    )
