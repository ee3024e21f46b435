"""A reward file: the user's own reward function (``verify.reward_function``), with veRL's signature
(docs/operations.md, "Your own reward", is the user's guide).

``path/to/file.py[:function]`` (default ``compute_score``) is called as veRL calls it, with keyword arguments
``data_source``, ``solution_str``, ``ground_truth`` and ``extra_info``. It returns the reward or a dict whose
``score`` is the reward, its other keys becoming columns of ``rewards.parquet`` (``plain_value``). A reward
``>= pass_threshold`` is ``correct``, any other finite one ``wrong``; a function that raises or returns
anything else gives its item ``error`` (reward 0). The file is imported in the verifier pool's workers
only (``coba_tasks.engines.verify_pool``), never in the trainer's process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import numbers
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coba_tasks.engines.verify import Verdict, VerdictKind

DEFAULT_FUNCTION = "compute_score"  # veRL's custom_reward_function.name default
KEY = "verify.reward_function"
FIX = (
    "point verify.reward_function at path/to/file.py:function, a file with "
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None)"
)
DETAIL_CHARS = 500  # the longest detail written for one item


class RewardFileError(ValueError):
    """A reward file that cannot be used; the message is one line naming the key, the path and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def split_spec(spec: str) -> tuple[str, str]:
    """``path.py:function`` -> (path, function); the function is ``compute_score`` when left out.

    >>> split_spec("rewards/mine.py:my_score"), split_spec("rewards/mine.py")
    (('rewards/mine.py', 'my_score'), ('rewards/mine.py', 'compute_score'))
    """
    text = spec.strip()
    path, sep, name = text.rpartition(":")
    if not sep or not name.isidentifier():
        path, name = text, DEFAULT_FUNCTION
    if not path.endswith(".py") or not Path(path).stem or not name.isidentifier():
        raise RewardFileError(
            f"{KEY} = {spec!r}: must be path/to/file.py or path/to/file.py:function "
            "(veRL's custom_reward_function.path and .name); leave it empty for the built-in verifiers"
        )
    return path, name


@dataclass(frozen=True)
class RewardFunction:
    """A reward file's function by reference (absolute path and name): what the pool sends its workers,
    which import the file themselves. ``pass_threshold``: a reward at or above it is ``correct``."""

    path: str
    name: str = DEFAULT_FUNCTION
    pass_threshold: float = 1.0

    @classmethod
    def from_spec(cls, spec: str, pass_threshold: float = 1.0, root: str | Path | None = None) -> RewardFunction:
        """From the config's ``path.py[:function]``; a relative path is taken from ``root`` (default: the
        working directory), so that worker processes find the same file."""
        path, name = split_spec(spec)
        full = Path(path).expanduser()
        if not full.is_absolute():
            full = (Path(root) if root is not None else Path.cwd()) / full
        return cls(str(full.resolve()), name, float(pass_threshold))

    @property
    def label(self) -> str:
        """``file.py:function``, for verdict details."""
        return f"{Path(self.path).name}:{self.name}"

    def load(self) -> Callable[..., Any]:
        """The function, imported once per process; RewardFileError (one line) when it cannot be."""
        return _import_function(self.path, self.name)


@functools.cache  # a file that failed is tried again: an exception is not cached
def _import_function(path: str, name: str) -> Callable[..., Any]:
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise RewardFileError(f"{KEY}: {path} {what}; {FIX}")
    module_name = "coba_reward_" + hashlib.sha256(path.encode()).hexdigest()[:16]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise RewardFileError(f"{KEY}: {path} cannot be imported as a Python file; {FIX}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # as an import does: the file's classes and pickles find their module
        try:
            spec.loader.exec_module(module)
        except KeyboardInterrupt:
            del sys.modules[module_name]
            raise
        except BaseException as exc:  # SyntaxError, ImportError, SystemExit, anything the file raises
            del sys.modules[module_name]
            raise RewardFileError(
                f"{KEY}: {path} does not import: {exception_line(exc, path)}; fix the file or its imports"
            ) from None
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        shown = f" (it defines {', '.join(defined[:8])})" if defined else ""
        raise RewardFileError(
            f"{KEY}: {path} has no {name!r}{shown}; define {name}(data_source, solution_str, ground_truth, "
            f"extra_info=None) in it or name the function with {path}:<function>"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardFileError(
            f"{KEY}: {path}:{name} is a {type(fn).__name__}, not a function; name a function of the file "
            f"with {path}:<function>"
        )
    return fn


def exception_line(exc: BaseException, path: str | None = None) -> str:
    """The last line of ``exc``'s traceback (``ValueError: message``, the message on one line), and the
    line of ``path`` it was raised from when that file is in the traceback."""
    raw = exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)  # without "(file, line N)"
    message = " ".join(str(raw).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    line = None
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        line = exc.lineno
    elif path is not None:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        line = frames[-1].lineno if frames else None
    where = f" ({Path(path).name} line {line})" if path is not None and line is not None else ""
    if len(text) + len(where) > DETAIL_CHARS:
        text = text[: max(0, DETAIL_CHARS - len(where) - 3)] + "..."
    return text + where


# --------------------------------------------------------------------------- scoring one item (in a worker)


def reward_verdict(
    reward: RewardFunction, data_source: str, extra_info: Mapping[str, Any] | None, completion: str, ground_truth: str
) -> Verdict:
    """Call the reward function on one completion as veRL does; never raises for the function's faults."""
    try:
        fn = reward.load()
    except RewardFileError as exc:
        return Verdict.of(VerdictKind.ERROR, detail=str(exc))
    try:
        out = fn(
            data_source=data_source,
            solution_str=completion,
            ground_truth=ground_truth,
            extra_info=dict(extra_info or {}),
        )
    except KeyboardInterrupt:
        raise
    except (Exception, SystemExit) as exc:
        return Verdict.of(VerdictKind.ERROR, detail=f"{reward.label}: {exception_line(exc, reward.path)}")
    return verdict_of(out, reward)


def verdict_of(out: Any, reward: RewardFunction) -> Verdict:
    """A reward function's return value as a verdict: a finite number, or a dict with a numeric ``score``."""
    extra: list[tuple[str, Any]] = []
    value = out
    if isinstance(out, Mapping):
        if "score" not in out:
            keys = ", ".join(map(repr, list(out)[:8])) or "none"
            return Verdict.of(
                VerdictKind.ERROR,
                detail=f"{reward.label}: returned a dict without a 'score' key (keys: {keys}); "
                "veRL reads the reward from result['score']",
            )
        value = out["score"]
        extra = [(str(k), plain_value(v)) for k, v in out.items() if k != "score"]
    if not isinstance(value, numbers.Real) and _is_scalar(value):
        value = value.item()  # a numpy scalar or a 0-d array or tensor
    if not isinstance(value, numbers.Real):
        what = "its 'score'" if isinstance(out, Mapping) else "it"
        return Verdict.of(
            VerdictKind.ERROR,
            detail=f"{reward.label}: {what} returned {type(value).__name__} {_short(value)}, "
            "not a number (return a float or a dict with a 'score' key)",
        )
    score = float(value)
    if not math.isfinite(score):
        return Verdict.of(VerdictKind.ERROR, detail=f"{reward.label}: returned the reward {score}, not a finite number")
    return Verdict.graded_score(score, score >= reward.pass_threshold, extra)


def plain_value(value: Any) -> bool | int | float | str | None:
    """An extra key's value as written to ``rewards.parquet``: bools, numbers, strings and None as they
    are (numpy scalars as Python ones); anything else as JSON text, or ``repr`` when JSON cannot hold it.

    >>> plain_value(3), plain_value("a"), plain_value([1, "x"]), plain_value({"k": 1.5})
    (3, 'a', '[1, "x"]', '{"k": 1.5}')
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if _is_scalar(value):  # a numpy bool_ or 0-d array
        return plain_value(value.item())
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=True, default=_not_json)
    except (TypeError, ValueError):
        return repr(value)


def _is_scalar(value: Any) -> bool:
    """A numpy scalar, or a 0-d array or tensor: ``.item()`` gives its Python value."""
    return callable(getattr(value, "item", None)) and tuple(getattr(value, "shape", (0,))) == ()


def _not_json(value: Any) -> Any:
    if hasattr(value, "tolist"):  # a numpy array
        return value.tolist()
    raise TypeError


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
