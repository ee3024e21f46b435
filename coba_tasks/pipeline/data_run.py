"""A run's datasets after every check (``load_run_datasets``), and the ground-truth check (``check_ground_truths``).

``load_run_datasets`` loads a run's train and test files (``coba_tasks.pipeline.data.read_dataset``),
keeps the configured difficulty levels (``keep_difficulties``), checks every ground truth with its
verifier (``check_ground_truths``), renders and tokenizes the prompts and checks their length
(``coba_tasks.pipeline.data_prompts``), as ``coba run`` and the training flow do before a run
starts. ``RunDatasets`` holds the result and the skipped rows (``bad_rows.parquet`` of a run).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from coba_tasks.pipeline.config_sections import MAIN_TEST_SET, UnknownSources, test_set_name
from coba_tasks.pipeline.data import is_string_type, read_dataset
from coba_tasks.pipeline.data_problems import DatasetError, OnBadRows, Problem, all_bad_note, refuse_or_skip
from coba_tasks.pipeline.data_prompts import check_prompt_lengths, model_context, render_prompts

if TYPE_CHECKING:
    from coba_tasks.engines.reward_file import RewardFunction
    from coba_tasks.pipeline.config import Config

BAD_ROWS_COLUMNS = ("key", "file", "row", "column", "message")  # bad_rows.parquet of a run


@dataclass
class RunDatasets:
    """A run's prompts after every check: what ``load_run_datasets`` gives."""

    train: pd.DataFrame | None  # None when not asked for (a continuing run has its prompts table)
    test: pd.DataFrame
    extra_tests: dict[str, pd.DataFrame] = field(default_factory=dict)  # data.extra_tests: set name -> prompts
    skipped: dict[str, tuple[str, list[Problem]]] = field(default_factory=dict)  # config key -> (file, problems)
    tokenizer: Any = None  # the model's tokenizer, which rendered the prompts
    train_file: str = ""  # data.train, when it was loaded
    overlap: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # test key -> (file, shared, prompts)

    def bad_rows(self) -> pd.DataFrame:
        """The skipped rows as a table (``BAD_ROWS_COLUMNS``), written to a run as bad_rows.parquet."""
        records = [
            (key, file, -1 if p.row is None else p.row, p.column, p.message)
            for key, (file, problems) in self.skipped.items()
            for p in problems
        ]
        frame = pd.DataFrame(records, columns=list(BAD_ROWS_COLUMNS))
        return frame.astype({"key": str, "file": str, "row": "int64", "column": str, "message": str})

    def skip_lines(self) -> list[str]:
        """One line per file with skipped rows: ``skipped N bad rows of FILE (see bad_rows.parquet)``."""
        return [
            f"skipped {len(problems)} bad row{'s' if len(problems) != 1 else ''} of {file} (see bad_rows.parquet)"
            for file, problems in self.skipped.values()
            if problems
        ]

    def overlap_lines(self) -> list[str]:
        """One warning per held-out set that shares prompt texts with data.train, with the count."""
        return [
            f"warning: {shared} of {total} prompts of {file} ({key}) have the same text as a prompt of "
            f"{self.train_file} (data.train): held-out accuracy counts them; remove them from one of the files "
            "for a clean held-out set"
            for key, (file, shared, total) in self.overlap.items()
            if shared
        ]


def shared_prompts(train: pd.DataFrame, test: pd.DataFrame) -> int:
    """How many of ``test``'s prompts have the text of a prompt of ``train`` (last user message, stripped)."""
    seen = set(train["prompt_text"].str.strip())
    return int(test["prompt_text"].str.strip().isin(seen).sum())


_TRUTH_CHECKED: dict[tuple[str, str], str | None] = {}  # (ground truth, source) -> reason; per process
_REWARD_CHECKED: set[tuple[str, str, str, float]] = set()  # (path, function, sha256, time limit); per process


def reward_function(cfg: Config) -> RewardFunction | None:
    """The run's reward file (``verify.reward_function``), checked, or None for the built-in verifiers.

    The check imports the file in a verifier worker under ``verify.timeout_s``, never in this process (its
    top-level code is the user's: it runs where the items are scored, with the same limit). A file that does
    not exist or import in time, or lacks the function, or whose name is not a function, is a
    ``RewardFileError`` (a ValueError): one line naming the key, the path and the fix, before anything
    starts. The run's verifier workers import the same file again (by its absolute path). A file checked
    once in this process is not checked again until its bytes change."""
    from coba_tasks.engines.fileio import sha256_file
    from coba_tasks.engines.reward_file import RewardFunction
    from coba_tasks.engines.verify_pool import check_reward_function

    if not cfg.verify.reward_function.strip():
        return None
    rf = RewardFunction.from_spec(cfg.verify.reward_function, cfg.verify.pass_threshold)
    try:
        digest = sha256_file(rf.path)
    except OSError:  # missing or unreadable: the check says which, in one line
        digest = ""
    key = (rf.path, rf.name, digest, cfg.verify.timeout_s)
    if key not in _REWARD_CHECKED:
        check_reward_function(rf, cfg.verify.timeout_s)
        _REWARD_CHECKED.add(key)
    return rf


def check_ground_truths(
    df: pd.DataFrame,
    path: str | os.PathLike[str],
    on_bad_rows: OnBadRows = "error",
    unknown_sources: str = "error",
    workers: int = 2,
    timeout_s: float = 5.0,
) -> tuple[pd.DataFrame, list[Problem]]:
    """Check every row's ground truth with the verifier its ``data_source`` names (``Verifier.check``, run
    in verifier worker processes with the hard ``timeout_s`` limit): a ground truth it cannot read is a bad
    row (``on_bad_rows``), never a prompt whose every rollout scores ``error`` (pass rate 0, where CoBA-RL
    would spend budget).

    A ``data_source`` no verifier is registered for stops the run (``DatasetError`` naming the sources, the
    registered ones and how to register one), unless ``unknown_sources`` is ``math``: then math-verify
    scores those rows, as it checks them here. Results are kept for the process, so a second load of the
    same rows (``coba run`` checks, then its flow) costs nothing.
    """
    from coba_tasks.engines.verify import (
        UNKNOWN_SOURCE_HINT,
        registered_verifiers,
    )
    from coba_tasks.engines.verify import unknown_sources as find_unknown
    from coba_tasks.engines.verify_pool import VerifierPool

    if unknown_sources not in get_args(UnknownSources):
        words = ", ".join(get_args(UnknownSources))
        raise ValueError(f"unknown_sources must be one of {words}, got {unknown_sources!r}")
    if df.empty:
        return df, []
    unknown = find_unknown(df["data_source"])
    if unknown and unknown_sources == "error":
        rows = df.index[df["data_source"].isin(unknown)].tolist()
        shown = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
        raise DatasetError(
            path,
            f"data_source {', '.join(map(repr, unknown))} (rows {shown}) has no verifier; registered: "
            f"{', '.join(registered_verifiers())}. {UNKNOWN_SOURCE_HINT[0].upper()}{UNKNOWN_SOURCE_HINT[1:]}",
        )
    items = list(zip(df["ground_truth"].astype(str), df["data_source"].astype(str), strict=True))
    todo = [item for item in dict.fromkeys(items) if item not in _TRUTH_CHECKED]
    if todo:
        with VerifierPool(workers=workers, timeout_s=timeout_s) as pool:
            _TRUTH_CHECKED.update(zip(todo, pool.check_truths(todo), strict=True))
    column = _ground_truth_column(path)
    problems = [
        Problem(column, reason, row=int(row))
        for row, item in zip(df.index, items, strict=True)
        if (reason := _TRUTH_CHECKED[item]) is not None
    ]
    refuse_or_skip(path, len(df), problems, on_bad_rows)
    bad = {p.row for p in problems}
    return (df[[r not in bad for r in df.index]] if problems else df), problems


def _ground_truth_column(path: str | os.PathLike[str]) -> str:
    """Where a file keeps its ground truths: ``reward_model.ground_truth`` (veRL) or ``answer`` (flat)."""
    try:
        prompt = pq.read_schema(path).field("prompt").type
    except (KeyError, pa.ArrowException, OSError):
        return "ground_truth"
    return "answer" if is_string_type(prompt) else "reward_model.ground_truth"


def load_run_datasets(cfg: Config, train: bool = True) -> RunDatasets:
    """Load and check a run's datasets: the reward file, if any (``reward_function``), every row
    (``load_dataset``), every ground truth with its verifier (``check_ground_truths``; not with a reward
    file, which reads the ground truths itself), rendered and tokenized as the model will see it
    (``render_prompts`` with ``data.prompt_format``), and every prompt's length.

    ``data.on_bad_rows`` says whether a bad row stops the run or is skipped. The context is
    ``rollout.max_model_len``, or the model's ``max_position_embeddings`` when that is 0 (no
    length check when the model declares none). The frames come back with a fresh 0..n-1 index.

    Raises:
        DatasetError: a bad file, or bad rows that are not skipped (``data.train`` / ``data.test``).
        ConfigError: the model's tokenizer or config cannot be read (naming ``model.path``).
    """
    # a reward file scores every row whatever its data_source: no ground-truth check by a built-in verifier
    custom_reward = reward_function(cfg) is not None
    tokenizer, context, context_from = model_context(
        cfg.model.path, cfg.model.trust_remote_code, cfg.rollout.max_model_len
    )
    out = RunDatasets(train=None, test=pd.DataFrame(), tokenizer=tokenizer)
    keys = (("data.train", cfg.data.train),) if train else ()
    extra = tuple((f"data.extra_tests[{i}]", p) for i, p in enumerate(cfg.data.extra_tests))
    v = cfg.verify
    for key, path in (*keys, ("data.test", cfg.data.test), *extra):
        df, problems = read_dataset(path, on_bad_rows=cfg.data.on_bad_rows)
        df = keep_difficulties(df, cfg.data.difficulties, path)
        rows = len(df) + len(problems)
        try:
            df, bad_truths = (
                (df, [])
                if custom_reward
                else check_ground_truths(df, path, cfg.data.on_bad_rows, v.unknown_sources, v.workers, v.timeout_s)
            )
        except DatasetError as e:
            if not problems or not e.problems:
                raise
            # skipping: the rows left after the load all have bad ground truths; report the whole file's rows
            every = sorted(problems + e.problems, key=lambda p: p.row or 0)
            raise DatasetError(path, every, note=all_bad_note(rows)) from e
        problems = sorted(problems + bad_truths, key=lambda p: p.row or 0)
        df, unrendered = render_prompts(df, tokenizer, cfg.data.prompt_format)
        if unrendered:
            if cfg.data.on_bad_rows == "error":
                raise DatasetError(path, unrendered)
            problems = sorted(problems + unrendered, key=lambda p: p.row or 0)
            if df.empty:
                raise DatasetError(path, problems, note=all_bad_note(rows))
        if context is not None:
            try:
                df, too_long = check_prompt_lengths(
                    df, context, cfg.rollout.max_tokens, path, cfg.data.on_bad_rows, context_from
                )
            except DatasetError as e:
                if not problems:
                    raise
                # skipping: the rows left after the load are all too long; report the whole file's rows
                every = sorted(problems + e.problems, key=lambda p: p.row or 0)
                raise DatasetError(path, every, note=all_bad_note(len(df) + len(problems))) from e
            problems = sorted(problems + too_long, key=lambda p: p.row or 0)
        if problems:
            out.skipped[key] = (str(path), problems)
        if key.startswith("data.extra_tests"):
            out.extra_tests[test_set_name(path)] = df.reset_index(drop=True)
        else:
            setattr(out, key.removeprefix("data."), df.reset_index(drop=True))
        if out.train is not None and key != "data.train":  # held-out prompts that are training prompts too
            out.train_file = str(cfg.data.train)
            out.overlap[key] = (str(path), shared_prompts(out.train, df), len(df))
    return out


def keep_difficulties(df: pd.DataFrame, levels: Sequence[int], path: str | os.PathLike[str]) -> pd.DataFrame:
    """The rows of ``df`` whose difficulty is in ``levels`` (``data.difficulties``; empty keeps every row).

    Raises:
        ConfigError: the file has no difficulty levels, or none of its rows is of those levels.
    """
    from coba_tasks.pipeline.config_fields import ConfigError

    if not levels:
        return df
    present = sorted(int(x) for x in df["difficulty"].unique()) if "difficulty" in df else []
    if not present or present == [-1]:
        raise ConfigError(
            f"data.difficulties = {list(levels)}: {path} has no difficulty levels (extra_info.difficulty or a "
            "difficulty column); set data.difficulties=[] (coba eval: --difficulties all) to keep every row"
        )
    kept = df[df["difficulty"].isin(list(levels))]
    if kept.empty:
        raise ConfigError(
            f"data.difficulties = {list(levels)}: no row of {path} is of those levels (it has levels "
            f"{', '.join(map(str, present))})"
        )
    return kept.reset_index(drop=True)


def sample_eval_prompts(test: pd.DataFrame, prompts: int, seed: int) -> pd.DataFrame:
    """The held-out prompts an evaluation scores: a sample of ``prompts`` rows seeded by ``seed`` (the run
    config's data.eval_prompts and run.seed), or every row when ``prompts`` is 0 or not below their count.

    >>> test = pd.DataFrame({"prompt_id": list("abcde")})
    >>> sample_eval_prompts(test, 2, seed=0)["prompt_id"].tolist(), len(sample_eval_prompts(test, 0, seed=0))
    (['c', 'a'], 5)
    """
    return test.sample(prompts, random_state=seed).reset_index(drop=True) if 0 < prompts < len(test) else test


def eval_prompt_set(cfg: Config, test: pd.DataFrame, extra: Mapping[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """The prompts every evaluation scores, with their ``test_set``: the ``data.eval_prompts`` sample
    (seeded by ``run.seed``) of data.test (``MAIN_TEST_SET``), and the same positions of each extra set
    (``data.extra_tests``: the same problems when the files list them in the same order), whose
    prompt ids are prefixed with the set's name so that every row of an evaluation has its own id."""
    n, seed = cfg.data.eval_prompts, cfg.run.seed
    frames = [sample_eval_prompts(test, n, seed).assign(test_set=MAIN_TEST_SET)]
    for name, df in (extra or {}).items():
        renamed = {"test_set": name, "prompt_id": lambda d, name=name: name + "/" + d["prompt_id"]}
        frames.append(sample_eval_prompts(df, n, seed).assign(**renamed))
    return pd.concat(frames, ignore_index=True)
