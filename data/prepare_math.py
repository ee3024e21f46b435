"""Prepare math datasets downloaded from the Hugging Face hub as veRL Parquet files for `coba run`.

Reads local files (nothing is downloaded here; docs/real_models.md says where to get them):

- **veRL / DAPO layout**, e.g. BytedTsinghua-SIA/DAPO-Math-17k (``data/dapo-math-17k.parquet``):
  ``prompt`` (list of ``{role, content}``), ``reward_model`` ``{ground_truth, style}``,
  ``data_source`` (``math_dapo``), ``ability``, ``extra_info`` ``{index}``. The prompt is kept as
  it is (DAPO's asks for a last line ``Answer: ...``). The hub file repeats each of its ~17.9k
  prompts about 100 times: duplicates are dropped here.
- **flat layout**, e.g. HuggingFaceH4/MATH-500 (``test.jsonl``: ``problem``, ``answer``,
  ``level``, ``unique_id``) or an AIME set (``problem`` or ``question``, ``answer``, ``id``):
  Parquet, JSON Lines or JSON. Column names are matched without regard to case. The problem is
  wrapped in a prompt template (``--template``, default ``dapo``: the same instruction as the
  DAPO training prompts, so the model answers evaluation problems in the form it is trained on).

Writes one veRL Parquet file (``coba_tasks.pipeline.data.write_verl_parquet``) that
``coba_tasks.pipeline.data.load_dataset`` reads: ``data_source`` (the input's, or ``--source``; it picks
the verifier: math-verify, which also reads DAPO's ``Answer:`` line), ``prompt``, ``ability``,
``reward_model`` ``{style: "rule", ground_truth}``, ``extra_info`` ``{index, source_index,
difficulty}``. ``extra_info.index`` is the prompt id: a stable hash of the prompt's messages
(``coba_tasks.pipeline.data.prompt_hash``), so a problem keeps its id whatever the file order, a rerun
gives the same ids, and the same prompt in two files has the same id. ``source_index`` is the
input's own id (``extra_info.index``, ``unique_id``, ``id``) or its row number; ``difficulty`` is
MATH's ``level`` where there is one. Rows are deduplicated on the prompt (the first row is kept;
prompts given differing answers are counted); rows without a problem or an answer are dropped
and counted. ``--check-answers`` also drops rows whose ground truth math-verify cannot read.

Examples (from the repository root, after downloading into data/raw/):

    python data/prepare_math.py --input data/raw/dapo/data/dapo-math-17k.parquet \\
        --output data/math/dapo_math_17k.parquet
    python data/prepare_math.py --input data/raw/math500/test.jsonl --output data/math/math500.parquet \\
        --source math500
    python data/prepare_math.py --input data/raw/aime24/data/train-00000-of-00001.parquet \\
        --output data/math/aime24.parquet --source aime24
    python data/prepare_math.py --input data/raw/dapo/data/dapo-math-17k.parquet \\
        --output /tmp/dapo_small.parquet --limit 512 --check-answers
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

try:
    from coba_tasks.pipeline.data import load_dataset, prompt_hash, write_verl_parquet
except ModuleNotFoundError:  # a checkout without `pip install -e .`: import from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from coba_tasks.pipeline.data import load_dataset, prompt_hash, write_verl_parquet

# DAPO-Math-17K's own instruction (its prompts are this with the problem in the middle)
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
TEMPLATES = {
    "dapo": DAPO_TEMPLATE,
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "none": "{problem}",
}
PROBLEM_COLUMNS = ("problem", "question")
ANSWER_COLUMNS = ("answer", "final_answer", "ground_truth")
ID_COLUMNS = ("unique_id", "id", "idx", "index")
LEVEL_COLUMNS = ("level", "difficulty")
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


@dataclass
class Prepared:
    """What ``prepare`` kept and dropped."""

    rows_read: int = 0
    duplicates: int = 0  # rows whose prompt an earlier row already had
    conflicting: int = 0  # prompts whose duplicates carry a different ground truth (the first is kept)
    bad: list[str] = field(default_factory=list)  # one line per dropped row: file, row, why
    unreadable_answers: list[str] = field(default_factory=list)  # --check-answers
    records: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Reading


def read_table(path: Path) -> pa.Table:
    """A Parquet, JSON Lines or JSON file as an Arrow table."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(path)
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8").lstrip()
        frame = pd.read_json(path, lines=not text.startswith("["), dtype=False)
        columns = {}
        for name in frame.columns:
            values = [None if isinstance(v, float) and v != v else v for v in frame[name].tolist()]
            try:
                columns[str(name)] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types (answers as numbers and text): text
                columns[str(name)] = pa.array([None if v is None else str(v) for v in values], pa.string())
        return pa.table(columns)
    raise ValueError(f"{path}: expected a .parquet, .jsonl or .json file")


def is_verl(table: pa.Table) -> bool:
    """veRL layout: a ``prompt`` column of message lists and a ``reward_model`` column."""
    names = set(table.column_names)
    return {"prompt", "reward_model"} <= names and pa.types.is_list(table.schema.field("prompt").type)


def _column(table: pa.Table, candidates: Sequence[str]) -> str | None:
    lower = {name.lower(): name for name in table.column_names}
    return next((lower[c] for c in candidates if c in lower), None)


def _prompt_keys(prompt: pa.ChunkedArray) -> pa.Array:
    """One string per row naming its messages exactly (duplicates have equal keys); vectorised when every
    row holds one message, as DAPO's do."""
    prompt = prompt.combine_chunks()
    lengths = pc.list_value_length(prompt)
    if prompt.null_count == 0 and len(prompt) and pc.all(pc.equal(lengths, 1)).as_py():
        first = pc.list_element(prompt, 0)
        return pc.binary_join_element_wise(pc.struct_field(first, "role"), pc.struct_field(first, "content"), "\x00")
    return pa.array([json.dumps(m, sort_keys=True, ensure_ascii=False) for m in prompt.to_pylist()], pa.string())


def _first_rows(keys: pa.Array, truths: pa.Array) -> tuple[list[int], int]:
    """Row numbers of each key's first row, in file order; and how many keys have differing truths."""
    table = pa.table({"k": keys, "g": truths, "i": pa.array(range(len(keys)), pa.int64())})
    firsts = table.group_by("k", use_threads=False).aggregate([("i", "min")])["i_min"].to_pylist()
    pairs = table.group_by(["k", "g"], use_threads=False).aggregate([])
    per_key = pairs.group_by("k", use_threads=False).aggregate([("g", "count")])  # distinct non-null truths
    conflicting = int(pc.sum(pc.greater(per_key["g_count"], 1)).as_py() or 0)
    return sorted(firsts), conflicting


def _text(value: Any) -> str | None:
    """A ground truth or id cell as text (integral numbers without '.0'); None when missing."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value).strip()
    return text or None


def _level(value: Any) -> int | None:
    """MATH's level (1-5, or 'Level 3' in some copies) as an int; None when there is none."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float) and value == value:
        return int(value)
    digits = "".join(ch for ch in str(value) if ch.isdigit())
    return int(digits) if digits else None


def _verl_records(path: Path, table: pa.Table, source: str | None, out: Prepared) -> list[dict[str, Any]]:
    truths = pc.struct_field(table["reward_model"].combine_chunks(), "ground_truth").cast(pa.string())
    keep, conflicting = _first_rows(_prompt_keys(table["prompt"]), truths)
    out.duplicates += table.num_rows - len(keep)
    out.conflicting += conflicting
    records = []
    for row, raw in zip(keep, table.take(pa.array(keep, pa.int64())).to_pylist(), strict=True):
        messages = [
            {"role": m.get("role"), "content": m.get("content")} for m in raw.get("prompt") or [] if isinstance(m, dict)
        ]
        truth = _text((raw.get("reward_model") or {}).get("ground_truth"))
        extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
        user = [m["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], str)]
        if not user or not user[-1].strip() or truth is None:
            out.bad.append(f"{path}: row {row}: {'no ground truth' if user and user[-1].strip() else 'no prompt'}")
            continue
        records.append(
            {
                "messages": messages,
                "ground_truth": truth,
                "data_source": source or _text(raw.get("data_source")) or "math",
                "ability": _text(raw.get("ability")) or "math",
                "source_index": _text(extra.get("index")) or str(row),
                "difficulty": _level(extra.get("difficulty")),
            }
        )
    return records


def _flat_records(
    path: Path, table: pa.Table, source: str | None, template: str, out: Prepared
) -> list[dict[str, Any]]:
    problem_col, answer_col = _column(table, PROBLEM_COLUMNS), _column(table, ANSWER_COLUMNS)
    if problem_col is None or answer_col is None:
        raise ValueError(
            f"{path}: neither a veRL table (prompt list, reward_model) nor a flat one: needs a problem column"
            f" ({' or '.join(PROBLEM_COLUMNS)}) and an answer column ({' or '.join(ANSWER_COLUMNS)});"
            f" it has {', '.join(table.column_names)}"
        )
    id_col, level_col = _column(table, ID_COLUMNS), _column(table, LEVEL_COLUMNS)
    source_col = _column(table, ("data_source",))
    records = []
    for row, raw in enumerate(table.to_pylist()):
        problem, truth = _text(raw.get(problem_col)), _text(raw.get(answer_col))
        if problem is None or truth is None:
            out.bad.append(f"{path}: row {row}: {'no answer' if problem else 'no problem'}")
            continue
        records.append(
            {
                "messages": [{"role": "user", "content": TEMPLATES[template].format(problem=problem)}],
                "ground_truth": truth,
                "data_source": source or (_text(raw.get(source_col)) if source_col else None) or "math",
                "ability": "math",
                "source_index": (_text(raw.get(id_col)) if id_col else None) or str(row),
                "difficulty": _level(raw.get(level_col)) if level_col else None,
            }
        )
    return records


# ---------------------------------------------------------------------------------------------
# The recipe


def prepare(
    inputs: Sequence[str | Path],
    source: str | None = None,
    template: str = "auto",
    limit: int = 0,
    check_answers: bool = False,
    verify_timeout_s: float = 10.0,
) -> Prepared:
    """Read, deduplicate and check ``inputs``; the records to write are in ``.records``, in input order."""
    if template not in ("auto", *TEMPLATES):
        raise ValueError(f"--template must be auto or one of {', '.join(TEMPLATES)}, got {template!r}")
    out = Prepared()
    seen: dict[str, str] = {}  # prompt id -> ground truth, across input files
    for name in inputs:
        path = Path(name)
        table = read_table(path)
        out.rows_read += table.num_rows
        if is_verl(table):
            if template != "auto":
                raise ValueError(f"{path}: a veRL file keeps its prompts as they are; drop --template {template}")
            records = _verl_records(path, table, source, out)
        else:
            records = _flat_records(path, table, source, "dapo" if template == "auto" else template, out)
        for record in records:
            pid = prompt_hash(record["messages"])
            if pid in seen:
                out.duplicates += 1
                out.conflicting += seen[pid] != record["ground_truth"]
                continue
            seen[pid] = record["ground_truth"]
            out.records.append({**record, "prompt_id": pid})
    if check_answers:
        _drop_unreadable_answers(out, verify_timeout_s)
    if limit:
        out.records = out.records[:limit]
    return out


def _drop_unreadable_answers(out: Prepared, timeout_s: float) -> None:
    """Drop records whose ground truth math-verify cannot read: a boxed copy of it must score correct."""
    from coba_tasks.engines.verify_pool import score_batch

    items = [(f"\\boxed{{{r['ground_truth']}}}", r["ground_truth"], r["data_source"]) for r in out.records]
    verdicts = score_batch(items, timeout_s=timeout_s, workers=2)
    kept = []
    for record, verdict in zip(out.records, verdicts, strict=True):
        if str(verdict.verdict) == "correct":
            kept.append(record)
        else:
            out.unreadable_answers.append(
                f"prompt {record['prompt_id']} ({record['source_index']}): ground truth {record['ground_truth']!r}"
                f" scores {verdict.verdict} against itself"
            )
    out.records = kept


def write(prepared: Prepared, output: str | Path) -> Path:
    """The records as a veRL Parquet file (atomic, deterministic)."""
    if not prepared.records:
        raise ValueError("no rows left to write")
    frame = pd.DataFrame(
        {
            "data_source": [r["data_source"] for r in prepared.records],
            "prompt": [r["messages"] for r in prepared.records],
            "ability": [r["ability"] for r in prepared.records],
            "reward_model": [{"style": "rule", "ground_truth": r["ground_truth"]} for r in prepared.records],
            "extra_info": [
                {"index": r["prompt_id"], "source_index": r["source_index"], "difficulty": r["difficulty"]}
                for r in prepared.records
            ],
        }
    )
    return write_verl_parquet(frame, output)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Turn downloaded DAPO-Math-17K, MATH500 or AIME files into veRL Parquet for `coba run`.",
        epilog=__doc__[__doc__.index("Examples") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--input", nargs="+", required=True, help="Parquet / JSON Lines / JSON file(s), in order")
    parser.add_argument("--output", required=True, help="the veRL Parquet file to write")
    parser.add_argument(
        "--source",
        default=None,
        help="data_source of every row (picks the verifier; e.g. math500, aime24). Default: the input's own"
        " (veRL) or math (flat)",
    )
    parser.add_argument(
        "--template",
        default="auto",
        choices=("auto", *TEMPLATES),
        help="prompt of a flat input: dapo (the DAPO instruction, 'Answer:' line; what auto picks), boxed"
        " (\\boxed{} answer) or none (the bare problem). veRL prompts are kept as they are",
    )
    parser.add_argument("--limit", type=int, default=0, help="keep only the first N prompts (0 = all)")
    parser.add_argument(
        "--check-answers", action="store_true", help="drop rows whose ground truth math-verify cannot read"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists (never an input)")
    args = parser.parse_args(argv)
    if args.limit < 0:
        parser.error("--limit must be >= 0")
    out = Path(args.output).resolve()
    if any(Path(i).resolve() == out for i in args.input):
        print(
            f"error: --output {args.output} is one of the --input files; nothing was written: choose another",
            file=sys.stderr,
        )
        return 1
    if out.exists() and not args.overwrite:
        print(
            f"error: --output {args.output} exists; nothing was written: choose another, or pass --overwrite",
            file=sys.stderr,
        )
        return 1
    try:
        prepared = prepare(args.input, args.source, args.template, args.limit, args.check_answers)
        path = write(prepared, args.output)
    except (OSError, ValueError, pa.ArrowException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    loaded = load_dataset(path)  # the file reads back as a run will read it
    print(
        f"read {prepared.rows_read} rows from {len(args.input)} file(s); dropped {prepared.duplicates} duplicate"
        f" rows ({prepared.conflicting} prompts had differing answers: the first was kept),"
        f" {len(prepared.bad)} rows without a problem or answer"
        + (f", {len(prepared.unreadable_answers)} with an unreadable ground truth" if args.check_answers else "")
        + f"; wrote {len(loaded)} prompts to {path}"
    )
    for line in (prepared.bad + prepared.unreadable_answers)[:10]:
        print(f"  dropped: {line}", file=sys.stderr)
    sources = sorted(set(loaded["data_source"]))
    print(f"data_source: {', '.join(sources)}; difficulty levels: {sorted(set(loaded['difficulty']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
