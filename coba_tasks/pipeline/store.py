"""The run directory: the contract between stages, and the only code that knows where its files live and how
they are written (docs/design.md, "The run directory" for the layout and "The contracts" for the rules: every
file written to a temporary name and renamed; a stage done only when its manifest entry is there, the entry
added after the file and removed before it; tables written without pandas metadata or index, so equal frames
give equal bytes). ``read_table`` checks size and sha256 against the entry (a mismatch is a ``StoreError``
pointing to ``coba resume --repair``); ``is_done`` only that the entry and the file exist. One process writes
a run directory at a time: the training flow holds its ``.lock`` (``runlock``).
"""

from __future__ import annotations

import json
import operator
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from coba_tasks.engines.fileio import atomic_write, remove_stale_temporaries, sha256_file, write_parquet
from coba_tasks.pipeline.tables import (  # noqa: F401  (the store's names, where its readers look for them)
    PILOT_STAGES,
    ROUND_PAIR,
    ROUND_STAGES,
    SAMPLING_STAGES,
    STAGES,
    STEP_ORDER,
    Table,
    step_stages,
)

# 2: each step allocates its own budget (steps/t/budget.parquet is step t's first stage; no budget for a step
# after the last). Run directories of schema 1 were made by builds up to commit e79713f: continue them there.
SCHEMA_VERSION = 2
BUILDS: dict[Any, str] = {1: "commit e79713f or earlier (before each step allocated its own budget)"}

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "_manifest.json"
STEPS_DIR = "steps"
CHECKPOINTS_DIR = "checkpoints"
REPORT_DIR = "report"
SUMMARY_FILE = "summary.json"
CHECKPOINT_FILE = "checkpoint.json"  # a checkpoint's own manifest, written last (coba_tasks.engines.checkpoint)
STEP_DIGITS = 6

# A table name is one path component: letters, digits, '_' and '-', not starting with '_' or '-'
# (names starting with '_' are the store's own files, names starting with '.' are temporaries).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")
# A component of a relative path for write_json / read_json: the same, plus dots after the first char.
_COMPONENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_STEP_DIR_RE = re.compile(rf"\d{{{STEP_DIGITS},}}")
_REPAIR_HINT = "run `coba resume --repair` to recompute it"


class StoreError(ValueError):
    """A run directory is missing, of another schema version, corrupt, or asked for a bad name."""


def inside_run(root: str | os.PathLike[str], path: Path) -> Path:
    """``path`` when it resolves (every symlink followed) inside the run directory ``root``, else StoreError: the
    one rule for every path a command writes, deletes or reads under a run, so nothing outside it is touched
    through a link."""
    real = Path(path).resolve()
    if not real.is_relative_to(Path(root).resolve()):
        raise StoreError(
            f"{path} resolves to {real}, outside the run directory {root}; a run's files live inside it: "
            "replace the link by the real directory or file"
        )
    return Path(path)


class RunStore:
    """A handle on one run directory: ``RunStore(root)`` only remembers the path, ``create`` makes a new run
    there, ``open`` checks that one exists of this schema version. A table name is a ``Table`` or a string."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._run_info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RunStore({str(self.root)!r})"

    # --- The run

    def create(
        self,
        config_dict: Mapping[str, Any],
        config_hash: str,
        versions: Mapping[str, str],
        inputs: Mapping[str, Any] | None = None,
    ) -> None:
        """Start a new run: write ``config.yaml`` (``config_dict``: YAML-safe values), then ``run.json`` (last: it
        marks the run), recording ``config_hash`` (also in every manifest entry), package ``versions`` and
        ``inputs`` (config key -> path and sha256). StoreError when a run or run files without a run.json are
        there, or ``config_hash`` is empty."""
        if (self.root / RUN_FILE).exists():
            raise StoreError(
                f"{self.root}: a run already exists here ({RUN_FILE} found); "
                f"continue it with `coba resume --run-dir {self.root}` or choose another run name"
            )
        leftovers = [p for p in (CONFIG_FILE, STEPS_DIR, CHECKPOINTS_DIR, MANIFEST_FILE) if (self.root / p).exists()]
        if leftovers:
            raise StoreError(
                f"{self.root}: holds run files ({', '.join(leftovers)}) but no {RUN_FILE}; "
                "remove the directory or choose another run name"
            )
        if not isinstance(config_hash, str) or not config_hash:
            raise StoreError(f"create: config_hash must be a non-empty string, got {config_hash!r}")
        self.root.mkdir(parents=True, exist_ok=True)
        config_text = yaml.safe_dump(dict(config_dict), sort_keys=False, allow_unicode=True)
        atomic_write(self.root / CONFIG_FILE, lambda f: f.write(config_text.encode("utf-8")))
        info: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "created": _now(), "config_hash": config_hash}
        info["versions"] = dict(versions)
        if inputs is not None:
            info["inputs"] = dict(inputs)
        _write_json_file(self.root / RUN_FILE, info)
        self._run_info = info

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> RunStore:
        """Open an existing run; StoreError when run.json is missing, unreadable or of another schema version."""
        store = cls(root)
        store._load_run_info()
        return store

    @property
    def config_hash(self) -> str:
        """The config hash recorded in run.json."""
        return self._load_run_info()["config_hash"]

    @property
    def run_info(self) -> dict[str, Any]:
        """The contents of run.json (schema_version, created, config_hash, versions); a copy."""
        return dict(self._load_run_info())

    def read_config(self) -> dict[str, Any]:
        """config.yaml as ``create`` wrote it; StoreError (one line) when it is missing, unreadable or not a mapping."""
        path = self.root / CONFIG_FILE
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StoreError(f"{path} is missing: the run's config cannot be read") from None
        except (OSError, UnicodeDecodeError) as e:
            raise StoreError(f"{path}: unreadable ({e})") from e
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(e, "problem", None) or type(e).__name__
            raise StoreError(
                f"{path}: damaged, not valid YAML{where} ({what}); restore it (run.json keeps its config hash)"
            ) from None
        if not isinstance(data, dict):
            raise StoreError(f"{path}: damaged, not a YAML mapping of config sections")
        return data

    def _load_run_info(self) -> dict[str, Any]:
        if self._run_info is not None:
            return self._run_info
        path = self.root / RUN_FILE
        if not path.is_file():
            raise StoreError(f"{self.root}: no run here ({RUN_FILE} is missing); start one with `coba run`")
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{path}: unreadable ({e})") from e
        version = info.get("schema_version") if isinstance(info, dict) else None
        if version != SCHEMA_VERSION:
            build = BUILDS.get(version, "a build of coba-rl other than this one (see the versions in run.json)")
            raise StoreError(
                f"{path}: written by schema version {version}; this build reads version {SCHEMA_VERSION}. "
                f"The run was made by {build}: continue or read it with a checkout of that build"
            )
        if not isinstance(info.get("config_hash"), str):
            raise StoreError(f"{path}: has no config_hash")
        self._run_info = info
        return info

    # --- Paths

    def step_dir(self, step: int) -> Path:
        """``steps/000007`` for step 7 (not created here)."""
        return self.root / STEPS_DIR / _step_name(step)

    def prune_checkpoints(self, keep: int, upto: int) -> list[Path]:
        """Delete all but the newest ``keep`` checkpoints at or below version ``upto`` (the run's policy now;
        ``keep`` 0 deletes nothing); the paths deleted. Only ``checkpoints()`` counts: a directory that is not a
        checkpoint, or one above ``upto``, is neither kept in a checkpoint's place nor deleted."""
        if keep <= 0:
            return []
        steps = [k for k in self.checkpoints() if k <= upto]
        gone = [inside_run(self.root, self.checkpoint_dir(s)) for s in steps[: max(0, len(steps) - keep)]]
        for path in gone:  # every one checked first: a link out of the run deletes nothing
            shutil.rmtree(path)
        return gone

    def checkpoints(self) -> list[int]:
        """The versions of the checkpoints there, oldest first: the directories named as a step
        (``checkpoints/000007``: 7) that hold a ``checkpoint.json``, whole or not (``verify_checkpoint`` tells);
        anything else under ``checkpoints/`` is not one."""
        root = self.root / CHECKPOINTS_DIR
        if not root.is_dir():
            return []
        return sorted(
            int(p.name)
            for p in root.iterdir()
            if _STEP_DIR_RE.fullmatch(p.name) and p.name == _step_name(int(p.name)) and (p / CHECKPOINT_FILE).is_file()
        )

    def checkpoint_dir(self, step: int) -> Path:
        """``checkpoints/000007``: the policy after 7 updates, written by the update of step 6 (not created here)."""
        return self.root / CHECKPOINTS_DIR / _step_name(step)

    def report_dir(self) -> Path:
        """``report/``, for plots and the HTML summary (not created here); refused (``inside_run``) when it
        resolves outside the run: the report writes and deletes files there."""
        return inside_run(self.root, self.root / REPORT_DIR)

    def table_path(self, step: int, name: str) -> Path:
        """``steps/000007/<name>.parquet``; the file may not exist."""
        return self.step_dir(step) / f"{_check_name(name)}.parquet"

    # --- Step tables

    def write_table(self, step: int, name: str, df: pd.DataFrame) -> Path:
        """Write ``df`` as ``steps/<step>/<name>.parquet`` atomically, then record it in the step's manifest; the
        path. The index is not written; list and struct columns are kept as Arrow lists and structs."""
        return _write_tracked(inside_run(self.root, self.step_dir(step)), _check_name(name), df, self.config_hash)

    def read_table(
        self, step: int, name: str, verify: bool = True, columns: Sequence[str] | None = None
    ) -> pd.DataFrame:
        """Read a done table (only ``columns``, when given), with ``verify`` checked against the manifest first;
        StoreError when it is not done, or its file is missing, altered, truncated or unreadable."""
        return _read_tracked(self.step_dir(step), _check_name(name), verify, columns)

    def damage(self, step: int, name: str) -> str | None:
        """Why a table of the step's manifest is unusable (``read_table``'s StoreError), or None when intact."""
        try:
            _read_tracked(self.step_dir(step), _check_name(name), verify=True)
        except StoreError as e:
            return str(e)
        return None

    def is_done(self, step: int, name: str) -> bool:
        """Whether the table has a manifest entry and its file exists (no hashing)."""
        return _is_tracked(self.step_dir(step), _check_name(name))

    def manifest(self, step: int) -> dict[str, dict[str, Any]]:
        """The step's manifest entries by table name; empty when nothing is done."""
        return _read_manifest(self.step_dir(step))

    def invalidate(self, step: int, name: str) -> None:
        """Forget a table: its manifest entry first, then its file (missing ones are fine; ``inside_run`` first)."""
        inside_run(self.root, self.table_path(step, name))
        _untrack(inside_run(self.root, self.step_dir(step)), _check_name(name))

    def steps(self) -> list[int]:
        """Every step that has a directory under ``steps/``, ascending."""
        base = self.root / STEPS_DIR
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.is_dir() and _STEP_DIR_RE.fullmatch(p.name))

    def steps_done(self, names: Iterable[str] = STAGES) -> list[int]:
        """The steps, ascending, whose directory holds every table of ``names`` as done."""
        wanted = [_check_name(n) for n in names]
        return [s for s in self.steps() if all(_is_tracked(self.step_dir(s), n) for n in wanted)]

    # --- Run-level tables (prompts.parquet, history.parquet), tracked in the root _manifest.json

    def write_run_table(self, name: str, df: pd.DataFrame) -> Path:
        """Write ``<root>/<name>.parquet`` atomically and record it in the run-level manifest."""
        name = _check_name(name)
        inside_run(self.root, self.root / f"{name}.parquet")  # a table linked out of the run: refused
        return _write_tracked(self.root, name, df, self.config_hash)

    def read_run_table(self, name: str, verify: bool = True) -> pd.DataFrame:
        """Read a run-level table, verified against the run-level manifest like ``read_table``."""
        return _read_tracked(self.root, _check_name(name), verify)

    def has_run_table(self, name: str) -> bool:
        """Whether the run-level table has a manifest entry and its file exists."""
        return _is_tracked(self.root, _check_name(name))

    # --- JSON files (summary.json, checkpoint metadata)

    def write_json(self, relpath: str | os.PathLike[str], obj: Any) -> Path:
        """Write ``obj`` as indented JSON to ``<root>/<relpath>`` atomically, creating directories. ``relpath``:
        '/'-separated, ending in ``.json``, inside the run, not run.json or a manifest (the store's own)."""
        path = self._resolve(relpath)
        if path.suffix != ".json":
            raise StoreError(f"write_json: {relpath!r} must end in .json")
        if path == self.root / RUN_FILE:
            raise StoreError(f"write_json: {RUN_FILE} is written by RunStore.create only")
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json_file(path, obj)
        return path

    def read_json(self, relpath: str | os.PathLike[str]) -> Any:
        """Read ``<root>/<relpath>`` as JSON: FileNotFoundError when it is missing, StoreError when the path
        escapes the run or the file is not JSON."""
        path = self._resolve(relpath)
        text = path.read_text(encoding="utf-8")
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise StoreError(f"{path}: not valid JSON ({e})") from e

    def step_json_path(self, step: int, name: str) -> Path:
        """``steps/<step>/<name>.json``: a step's records that are not stage outputs (not in the manifest)."""
        return self.step_dir(step) / f"{_check_name(name)}.json"

    def write_step_json(self, step: int, name: str, obj: Any) -> Path:
        """Write ``obj`` as ``steps/<step>/<name>.json`` (``write_json``)."""
        return self.write_json(self.step_json_path(step, name).relative_to(self.root).as_posix(), obj)

    def read_step_json(self, step: int, name: str) -> Any:
        """Read ``steps/<step>/<name>.json`` (``read_json``)."""
        return self.read_json(self.step_json_path(step, name).relative_to(self.root).as_posix())

    def _resolve(self, relpath: str | os.PathLike[str]) -> Path:
        """``root / relpath`` after checking every part is a plain name and the result stays inside root."""
        text = os.fspath(relpath)
        parts = PurePosixPath(text).parts
        bad = (
            not parts
            or "\\" in text
            or PurePosixPath(text).is_absolute()
            or not all(_COMPONENT_RE.fullmatch(p) for p in parts)
        )
        if bad:
            raise StoreError(
                f"{relpath!r}: not a path inside the run directory; use '/'-separated names of letters, digits, "
                "'_', '-' and '.', none starting with '.' or '_' (no '..', no absolute paths)"
            )
        return inside_run(self.root, self.root.joinpath(*parts))  # a symlink pointing outside is refused


# --- Tracked tables: a directory, its Parquet files and its _manifest.json


def _write_tracked(directory: Path, name: str, df: pd.DataFrame, config_hash: str) -> Path:
    """Untrack a previous version, write the file atomically, then add the manifest entry (last)."""
    if not isinstance(df, pd.DataFrame):
        raise StoreError(f"{name}: expected a pandas DataFrame, got {type(df).__name__}")
    table = pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None)
    directory.mkdir(parents=True, exist_ok=True)
    entries = _read_manifest(directory)
    if name in entries:  # never leave an entry that describes bytes about to be replaced
        del entries[name]
        _write_manifest(directory, entries)
    path = directory / f"{name}.parquet"
    # temporaries of this table and of the manifest left by a killed writer (one writer per run)
    remove_stale_temporaries(path)
    remove_stale_temporaries(directory / MANIFEST_FILE)
    write_parquet(table, path)
    entries[name] = {
        "file": path.name,
        "rows": table.num_rows,
        "bytes": path.stat().st_size,
        "schema_version": SCHEMA_VERSION,
        "sha256": sha256_file(path),
        "config_hash": config_hash,
        "written_at": _now(),
    }
    _write_manifest(directory, entries)
    return path


def _read_tracked(directory: Path, name: str, verify: bool, columns: Sequence[str] | None = None) -> pd.DataFrame:
    entries = _read_manifest(directory)
    path = directory / f"{name}.parquet"  # never a path taken from the manifest: it could point anywhere
    entry = entries.get(name)
    if entry is None:
        raise StoreError(f"{path}: not done (no entry in {directory / MANIFEST_FILE}); run the stage that writes it")
    if entry.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: written by schema version {entry.get('schema_version')}; this build reads version "
            f"{SCHEMA_VERSION}"
        )
    if not path.is_file():
        raise StoreError(f"{path}: listed in the manifest but missing; {_REPAIR_HINT}")
    if verify:
        size = path.stat().st_size
        if size != entry.get("bytes", size):
            raise StoreError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated?); {_REPAIR_HINT}")
        digest = sha256_file(path)
        if digest != entry.get("sha256"):
            raise StoreError(
                f"{path}: sha256 {digest[:12]}... does not match the manifest's {str(entry.get('sha256'))[:12]}... "
                f"(the file was altered); {_REPAIR_HINT}"
            )
    try:
        return pq.read_table(path, columns=None if columns is None else list(columns)).to_pandas()
    except (pa.ArrowException, OSError) as e:
        raise StoreError(f"{path}: unreadable Parquet ({e}); {_REPAIR_HINT}") from e


def _is_tracked(directory: Path, name: str) -> bool:
    return name in _read_manifest(directory) and (directory / f"{name}.parquet").is_file()


def _untrack(directory: Path, name: str) -> None:
    entries = _read_manifest(directory)
    entry = entries.pop(name, None)
    if entry is not None:
        _write_manifest(directory, entries)
    (directory / f"{name}.parquet").unlink(missing_ok=True)


def _read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    path = directory / MANIFEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON ({e}); {_REPAIR_HINT}") from e
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise StoreError(f"{path}: not a manifest (no 'entries' object); {_REPAIR_HINT}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: written by schema version {data.get('schema_version')}; this build reads version {SCHEMA_VERSION}"
        )
    return data["entries"]


def _write_manifest(directory: Path, entries: Mapping[str, Any]) -> None:
    _write_json_file(directory / MANIFEST_FILE, {"schema_version": SCHEMA_VERSION, "entries": dict(entries)})


def _write_json_file(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


# --- Names


def _step_name(step: int) -> str:
    """'000007' for 7; a step is a non-negative integer (bools refused)."""
    if isinstance(step, bool):
        raise StoreError(f"step must be a non-negative integer, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise StoreError(f"step must be a non-negative integer, got {step!r}") from None
    if value < 0:
        raise StoreError(f"step must be a non-negative integer, got {value}")
    return f"{value:0{STEP_DIGITS}d}"


def _check_name(name: str) -> str:
    """A table name as a plain string; one path component, no extension."""
    text = str(name) if isinstance(name, StrEnum) else name
    if not isinstance(text, str) or not _NAME_RE.fullmatch(text):
        raise StoreError(
            f"table name {name!r}: use letters, digits, '_' and '-', starting with a letter or digit, without "
            "'.parquet' (no '/', '..' or absolute paths: a table lives inside its directory)"
        )
    return text


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
