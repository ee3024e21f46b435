"""Answer verification: turn (completion, ground truth, data_source) into a reward and a verdict.

What. ``score(completion, ground_truth, data_source)`` picks a verifier by the row's
``data_source`` (a registry, ``register_verifier``) and returns a ``Verdict``: reward 1.0 or 0.0
and one of five outcomes, counted apart so that a broken verifier never passes as a wrong answer:

- ``correct`` / ``wrong``: an answer was found and compared with the ground truth;
- ``no_answer``: the completion holds no answer the verifier can read (reward 0);
- ``timeout``: no verdict within the wall-clock limit (reward 0);
- ``error``: the verifier raised, or its worker process died (reward 0; ``detail`` says why).

Verifiers:

- ``arith``: our synthetic arithmetic task. The completion is the model's text after a prompt
  such as ``37+58=``; the answer is the integer (optional ``-``) at its start, after optional
  whitespace, and anything after it is ignored. Exact integer comparison. A number with a
  fractional part (``95.5``) is ``wrong``; no number at all is ``no_answer``.
- ``math`` (also under the veRL names ``math_dapo``, ``lighteval/MATH``, ``openai/gsm8k``, ``aime``...;
  any unknown source falls back to it): math-verify. The ground truth is wrapped in ``\\boxed{}``
  unless it already is, and parsed; the completion is parsed with math-verify's LaTeX and
  expression extraction, then ``verify(gold, answer)`` (gold first: the comparison is not
  symmetric). A DAPO-style line ``Answer: X`` (the last such line) takes precedence over the rest
  of the text. Otherwise math-verify's own choice stands: the *last* ``\\boxed{}`` wins, and boxes
  written side by side (``\\boxed{1}, \\boxed{2}``) are read as the set ``{1, 2}``.

Why a process pool. math-verify bounds its own parsing and comparison time with
``signal.alarm``: that works only in the main thread, and its ``TimeoutException`` derives from
``BaseException``, so it escapes ``except Exception``. And some answers make sympy run for ever
(``\\boxed{9^{9^{9^{9}}}}`` against ``5`` never returns). So ``score`` calls math-verify with its
timeouts switched off (safe in any thread), and ``VerifierPool`` runs ``score`` in worker
processes (``spawn`` start method: safe beside torch's threads) with a hard wall-clock limit per
item: a stuck worker is killed and replaced and its item scored ``timeout``; a worker that dies
(``os._exit``, segfault) gives its item ``error`` and is replaced; the rest of the batch goes on.
The wall-clock limit is the guarantee for any input (deeply nested LaTeX, a megabyte-long box of
digits: both measured to run for minutes in sympy). A cheap guard in front of it:
a completion longer than ``max_chars`` (default 1,000,000 characters, far above what any
generation length produces) is scored ``error`` without being sent to a worker, so it costs
neither a worker's time limit nor a worker restart.

How to use::

    from coba_tasks.engines.verify import VerifierPool, count_verdicts, score, score_batch

    score("95", "95", "arith").verdict                # in-process, no timeout: trusted input only
    verdicts = score_batch(items, timeout_s=5.0)      # items: [(completion, ground_truth, data_source)]
    with VerifierPool(workers=4, timeout_s=5.0) as pool:  # a training run keeps one pool for all steps
        for step in steps:
            verdicts = pool.score(items_of(step))
            counts = count_verdicts(verdicts)         # {"correct": .., "wrong": .., ...}

Fast path: verifiers registered with ``in_process=True`` (``arith``: one regex, cannot hang) are
scored in the calling process, never sent to a worker; a batch of only such items starts no
process at all.

Custom verifiers: ``@register_verifier("my_source")`` on a module-level function
``(completion: str, ground_truth: str) -> Verdict``. Workers receive the function by reference
(pickle), so it must live in an importable module; a worker imports the modules of all verifiers
registered when it starts (so module import time does not count against an item's limit), and
any other on first use.

Determinism: a verdict depends only on its item, except ``timeout``, which depends on the clock.

Caveats: ``spawn`` re-imports the main script in each worker, so a script that scores batches
needs an ``if __name__ == "__main__":`` guard. A ground truth math-verify cannot parse is an
``error`` (a data problem), not ``wrong``. A pool round trip costs about 1 ms per item; a
math-verify item 3-40 ms (sympy simplification dominates; rarely a second or more).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from functools import lru_cache, partial
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 2
DEFAULT_MAX_CHARS = 1_000_000  # longer completions are scored `error` by the pool without parsing
STARTUP_TIMEOUT_S = 120.0  # a fresh worker imports sympy and math-verify before it says "ready"


class VerdictKind(StrEnum):
    CORRECT = "correct"
    WRONG = "wrong"
    NO_ANSWER = "no_answer"
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of scoring one completion.

    ``reward`` is 1.0 exactly when ``verdict`` is ``correct``; ``extracted_answer`` is the answer
    text the verifier read ("" if none); ``detail`` explains errors, timeouts and odd cases.
    """

    reward: float
    verdict: VerdictKind
    extracted_answer: str = ""
    detail: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.verdict, VerdictKind):
            object.__setattr__(self, "verdict", VerdictKind(self.verdict))
        expected = 1.0 if self.verdict is VerdictKind.CORRECT else 0.0
        if self.reward != expected:
            raise ValueError(
                f"Verdict {self.verdict.value!r} must have reward {expected}, got {self.reward}; "
                "build verdicts with Verdict.of(kind, ...)"
            )

    @classmethod
    def of(cls, kind: VerdictKind | str, extracted_answer: str = "", detail: str = "") -> Verdict:
        """Build a verdict whose reward follows from its kind."""
        kind = VerdictKind(kind)
        return cls(1.0 if kind is VerdictKind.CORRECT else 0.0, kind, extracted_answer, detail)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, one row of ``rewards.parquet``: reward, verdict, extracted_answer, detail."""
        row = asdict(self)
        row["verdict"] = self.verdict.value
        return row


def count_verdicts(verdicts: Iterable[Verdict]) -> dict[str, int]:
    """Count verdicts by kind; every kind is a key, in the order of ``VerdictKind``.

    >>> count_verdicts([Verdict.of("correct"), Verdict.of("wrong"), Verdict.of("correct")])
    {'correct': 2, 'wrong': 1, 'no_answer': 0, 'timeout': 0, 'error': 0}
    """
    counts = {kind.value: 0 for kind in VerdictKind}
    for v in verdicts:
        counts[v.verdict.value] += 1
    return counts


# --------------------------------------------------------------------------- registry

VerifierFn = Callable[[str, str], Verdict]


TruthCheck = Callable[[str], None]


@dataclass(frozen=True)
class Verifier:
    """A registered verifier: ``fn(completion, ground_truth) -> Verdict`` under a canonical name.

    ``in_process``: cheap and cannot hang, so batches score it in the calling process.
    ``check``: ``check(ground_truth)`` raises ``ValueError`` (saying why) for a ground truth this
    verifier cannot compare against; datasets are checked with it when they load.
    """

    name: str
    fn: VerifierFn
    in_process: bool = False
    check: TruthCheck | None = None

    def __call__(self, completion: str, ground_truth: str) -> Verdict:
        return self.fn(completion, ground_truth)


_REGISTRY: dict[str, Verifier] = {}
FALLBACK_SOURCE = "math"


def register_verifier(
    name: str, *aliases: str, in_process: bool = False, check: TruthCheck | None = None
) -> Callable[[VerifierFn], VerifierFn]:
    """Decorator: register ``fn`` as the verifier for ``name`` and each alias (data_source values).

    ``check`` (optional, a module-level function) is called on every ground truth of a dataset when it
    loads and raises ``ValueError`` for one ``fn`` cannot score against: such a row is a bad row
    (``data.on_bad_rows``), not a prompt whose every rollout scores ``error``.
    The function is returned unchanged, so it stays importable by reference from worker processes.
    Registering the same function again (a module imported twice) is a no-op.
    """

    def decorator(fn: VerifierFn) -> VerifierFn:
        entry = Verifier(name=name, fn=fn, in_process=in_process, check=check)
        for key in (name, *aliases):
            old = _REGISTRY.get(key)
            if old is not None and _qualified_name(old.fn) != _qualified_name(fn):
                raise ValueError(
                    f"data_source {key!r} already has the verifier {_qualified_name(old.fn)}; "
                    f"register {_qualified_name(fn)} under another name"
                )
            _REGISTRY[key] = entry
        return fn

    return decorator


def registered_verifiers() -> tuple[str, ...]:
    """All data_source names with a verifier, sorted."""
    return tuple(sorted(_REGISTRY))


def verifier_for(data_source: str, *, fallback: bool = True) -> Verifier:
    """The verifier for ``data_source``; unknown sources get the ``math`` verifier unless ``fallback=False``."""
    entry = _REGISTRY.get(data_source)
    if entry is not None:
        return entry
    if fallback:
        return _REGISTRY[FALLBACK_SOURCE]
    raise KeyError(
        f"no verifier for data_source {data_source!r}; registered: {', '.join(registered_verifiers())}. "
        "Register one with @register_verifier(name)"
    )


def unknown_sources(sources: Iterable[str]) -> list[str]:
    """The data_source values among ``sources`` that no verifier is registered for, sorted."""
    return sorted({str(x) for x in sources} - set(_REGISTRY))


UNKNOWN_SOURCE_HINT = (
    "register a verifier for it with @register_verifier(name) in a module the run imports "
    "(coba_tasks/engines/verify.py says how), or set verify.unknown_sources=math to score such rows with math-verify"
)


def _qualified_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --------------------------------------------------------------------------- scoring in this process


def score(completion: str, ground_truth: str, data_source: str = FALLBACK_SOURCE) -> Verdict:
    """Score one completion in this process, with no time limit (use ``VerifierPool`` for untrusted text).

    Never raises for a bad completion or ground truth: exceptions become ``error`` verdicts.

    >>> score("95 and more text", "95", "arith").verdict.value
    'correct'
    >>> score("  -7", "7", "arith").to_dict()
    {'reward': 0.0, 'verdict': 'wrong', 'extracted_answer': '-7', 'detail': ''}
    """
    return _run_verifier(verifier_for(data_source), completion, ground_truth)


def _run_verifier(verifier: Verifier, completion: str, ground_truth: Any) -> Verdict:
    try:
        if not isinstance(completion, str):
            raise TypeError(f"completion must be str, got {type(completion).__name__}")
        result = verifier.fn(completion, str(ground_truth))
        if not isinstance(result, Verdict):
            raise TypeError(f"verifier {verifier.name!r} returned {type(result).__name__}, not Verdict")
        return result
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # math-verify's TimeoutException is a BaseException
        mv_errors = sys.modules.get("math_verify.errors")
        timed_out = mv_errors is not None and isinstance(exc, mv_errors.TimeoutException)
        kind = VerdictKind.TIMEOUT if timed_out else VerdictKind.ERROR
        return Verdict.of(kind, detail=f"{verifier.name}: {type(exc).__name__}: {exc}")


_ARITH_ANSWER = re.compile(r"\s*(-?\d+)(\.\d+)?")


def arith_truth(ground_truth: str) -> None:
    """An arith ground truth is an integer (optional ``-``)."""
    if not re.fullmatch(r"-?\d+", ground_truth.strip()):
        raise ValueError(f"arith: ground truth {ground_truth!r} is not an integer")


@register_verifier("arith", in_process=True, check=arith_truth)
def arith_verifier(completion: str, ground_truth: str) -> Verdict:
    """The integer at the start of the completion (after whitespace) against the integer ground truth."""
    gold = int(ground_truth.strip())  # a non-integer ground truth raises: an `error`, a data problem
    m = _ARITH_ANSWER.match(completion)
    if m is None:
        return Verdict.of(VerdictKind.NO_ANSWER, detail="no integer at the start of the completion")
    if m.group(2):
        return Verdict.of(VerdictKind.WRONG, m.group(0).strip(), detail="not an integer")
    answer = int(m.group(1))
    return Verdict.of(VerdictKind.CORRECT if answer == gold else VerdictKind.WRONG, m.group(1))


_BOXED_CONTENT = re.compile(r"\\boxed\{([^{}]*)\}")
# an integer written alone (not part of a decimal), thousands separated by commas or not
_INTEGER_IN_TEXT = re.compile(r"(?<![\d.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?!\d|[.,]\d)")
_INTEGER_ALONE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")


_OPERAND_BEFORE = re.compile(r"\d\s*[-+*/×x]\s*$")  # "9-" or "9 - ": the integer after it is an operand


@register_verifier("arith_chat", in_process=True, check=arith_truth)
def arith_chat_verifier(completion: str, ground_truth: str) -> Verdict:
    """The arithmetic task asked of a chat model ("Compute 9-7. Put your final answer within \\boxed{}."):
    the integer in the last ``\\boxed{}`` of the completion, or, without a box, the last integer of the
    text that is not the right operand of an operator (in "9-7" or "9 - 7" the 7 is an operand, in
    "9 - 7 = 2" the 2 is not). The answer to "Compute 9-7" is a number: a box holding an expression
    (``\\boxed{9-7}``) is ``wrong``, and so is the question written back. math-verify, which evaluates
    expressions, scored both as correct, and a model trained on it learned to echo the question."""
    gold = int(ground_truth.strip())  # a non-integer ground truth raises: an `error`, a data problem
    boxes = _BOXED_CONTENT.findall(completion)
    if boxes:
        text = boxes[-1].strip().replace(" ", "")
        if not _INTEGER_ALONE.fullmatch(text):
            return Verdict.of(VerdictKind.WRONG, boxes[-1].strip(), detail="the box holds no integer")
        answer = int(text.replace(",", ""))
        return Verdict.of(VerdictKind.CORRECT if answer == gold else VerdictKind.WRONG, text)
    numbers = [
        m.group(0) for m in _INTEGER_IN_TEXT.finditer(completion) if not _OPERAND_BEFORE.search(completion[: m.start()])
    ]
    if not numbers:
        return Verdict.of(VerdictKind.NO_ANSWER, detail="no \\boxed{} and no integer result in the completion")
    answer = int(numbers[-1].replace(",", ""))
    return Verdict.of(VerdictKind.CORRECT if answer == gold else VerdictKind.WRONG, numbers[-1])


# The DAPO prompt asks for a last line "Answer: $Answer"; optional markdown bold around "Answer:".
_DAPO_ANSWER_LINE = re.compile(r"^[ \t]*\**answer\**[ \t]*:.*\S.*$", re.IGNORECASE | re.MULTILINE)


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off; we time items out ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _mv_parse(text: str) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # parsing_timeout=None: no signal.alarm (main-thread only); raise_on_error: errors become `error`
    return parse(
        text,
        extraction_config=(LatexExtractionConfig(), ExprExtractionConfig()),
        parsing_timeout=None,
        raise_on_error=True,
    )


@lru_cache(maxsize=4096)  # a group's G completions share one ground truth
def _parse_gold(ground_truth: str) -> tuple[Any, ...]:
    text = ground_truth.strip()
    if "\\boxed" not in text:
        text = "\\boxed{" + text.strip("$").strip() + "}"
    gold = tuple(_mv_parse(text))
    if not any(_is_math(g) for g in gold):
        raise ValueError(
            f"math-verify cannot parse the ground truth {ground_truth!r}; fix the dataset row "
            "or register a verifier for its data_source"
        )
    return gold


def _is_math(x: Any) -> bool:
    from sympy import Basic, MatrixBase

    return isinstance(x, Basic | MatrixBase)


def math_truth(ground_truth: str) -> None:
    """A math ground truth is one math-verify parses into a value that is a number (not NaN nor complex
    infinity, e.g. ``1/0``)."""
    from sympy import S, zoo

    for g in _parse_gold(ground_truth):  # raises ValueError when nothing parses
        if _is_math(g) and hasattr(g, "has") and g.has(S.NaN, zoo):
            raise ValueError(f"math: ground truth {ground_truth!r} is not a number ({g})")


@register_verifier(
    "math",
    "math_dapo",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math500",
    "openai/gsm8k",
    "gsm8k",
    "aime",
    "aime24",
    "aime25",
    "AIME",
    check=math_truth,
)
def math_verifier(completion: str, ground_truth: str) -> Verdict:
    """math-verify: the DAPO ``Answer:`` line if any, else math-verify's extraction of the whole text."""
    from math_verify import verify

    gold = _parse_gold(ground_truth)
    answer: list[Any] = []
    dapo_lines = _DAPO_ANSWER_LINE.findall(completion)
    if dapo_lines:
        answer = _mv_parse(dapo_lines[-1])
    if not any(_is_math(a) for a in answer):
        answer = _mv_parse(completion)
    if not answer:
        return Verdict.of(VerdictKind.NO_ANSWER, detail="math-verify found no answer")
    # parse returns [sympy object, its normalised text] or just [text] when the text did not parse
    extracted = next((a for a in answer if isinstance(a, str)), str(answer[0]))
    if verify(list(gold), answer, timeout_seconds=None, raise_on_error=True):
        return Verdict.of(VerdictKind.CORRECT, extracted)
    if not any(_is_math(a) for a in answer):
        return Verdict.of(VerdictKind.NO_ANSWER, extracted, detail="answer text found but not parsed")
    return Verdict.of(VerdictKind.WRONG, extracted)


def _truth_verdict(check: TruthCheck, completion: str, ground_truth: str) -> Verdict:
    """A ground-truth check as a verdict (so the pool runs it like a verifier): correct when usable."""
    try:
        check(ground_truth)
    except ValueError as exc:
        return Verdict.of(VerdictKind.ERROR, detail=str(exc))
    return Verdict.of(VerdictKind.CORRECT)


# --------------------------------------------------------------------------- worker processes


def _worker_main(conn: Connection, warmup: bool, preload: tuple[str, ...]) -> None:
    """Worker loop: receive (verifier, completion, ground_truth), send back a Verdict; None stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # reported as an `error` verdict by the first item that needs the module
            logger.warning("verifier worker: cannot import %s", module, exc_info=True)
    if warmup:  # import sympy and math-verify and fill its caches before taking items
        score("\\boxed{1}", "1", FALLBACK_SOURCE)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent went away
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # unpickling failed: the verifier's module does not import here
            conn.send(Verdict.of(VerdictKind.ERROR, detail=f"worker could not load the verifier: {exc!r}"))
            continue
        if msg is None:
            return
        verifier, completion, ground_truth = msg
        conn.send(_run_verifier(verifier, completion, ground_truth))


class _Worker:
    """One worker process, its pipe, and the item it is scoring (index into the batch, deadline)."""

    def __init__(self, ctx: Any, warmup: bool) -> None:
        # Import every registered verifier's module before taking items: import time must not
        # count against an item's limit. Modules registered later load on first use instead.
        preload = tuple(sorted({v.fn.__module__ for v in _REGISTRY.values()} - {__name__}))
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, warmup, preload), daemon=True, name="coba-verifier"
        )
        self.process.start()
        child_conn.close()  # so that the parent sees EOF when the worker dies
        self.started_at = time.monotonic()
        self.ready = False
        self.item: int | None = None
        self.deadline = float("inf")

    def stop(self, *, graceful: bool) -> None:
        if graceful and self.process.is_alive():
            try:
                self.conn.send(None)
                self.process.join(timeout=2.0)
            except OSError:
                pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


def _exit_detail(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"


class VerifierPool:
    """Worker processes that score items with a hard wall-clock limit per item; reuse it across steps.

    ``workers``: number of processes. ``timeout_s``: wall-clock limit per item, from the moment a
    worker takes it. ``start_method``: "spawn" (default) or "forkserver"; "fork" is refused
    (unsafe next to torch's threads). ``warmup``: workers import math-verify before taking
    items, so import time never counts against an item's limit. ``max_chars``: a completion
    longer than this is scored ``error`` at once, never sent to a worker (``None``: no limit;
    verifiers registered ``in_process`` are never limited). Not thread-safe: one caller.
    Workers start on the first batch that needs them and stop at ``close()`` / the end of ``with``.
    """

    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        start_method: str = "spawn",
        warmup: bool = True,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        max_chars: int | None = DEFAULT_MAX_CHARS,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        if max_chars is not None and max_chars < 1:
            raise ValueError(f"max_chars must be >= 1 or None, got {max_chars}")
        self.n_workers = workers
        self.timeout_s = float(timeout_s)
        self.warmup = warmup
        self.startup_timeout_s = startup_timeout_s
        self.max_chars = max_chars
        self.restarts = 0  # workers killed (timeout) or lost (crash) and replaced, over the pool's life
        self._ctx = get_context(start_method)
        self._workers: list[_Worker] = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes ([] before the first batch that needs them)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def start(self) -> VerifierPool:
        """Start the workers now and wait until each is ready (otherwise the first batch that needs them does)."""
        self._spawn_missing()
        while starting := [w for w in self._workers if not w.ready]:
            wait_s = max(0.0, min(w.started_at for w in starting) + self.startup_timeout_s - time.monotonic())
            wait([w.conn for w in starting] + [w.process.sentinel for w in starting], timeout=wait_s)
            for slot in range(len(self._workers)):
                self._service(slot, [], {})
        return self

    def close(self) -> None:
        """Stop every worker (politely, then by SIGKILL)."""
        for w in self._workers:
            w.stop(graceful=True)
        self._workers = []

    def score(self, items: Sequence[tuple[str, str, str]]) -> list[Verdict]:
        """Score ``(completion, ground_truth, data_source)`` items; verdicts in the order of ``items``."""
        entries = []
        for i, item in enumerate(items):
            if len(item) != 3:
                raise ValueError(f"item {i} has {len(item)} fields; expected (completion, ground_truth, data_source)")
            completion, ground_truth, source = item
            entries.append((verifier_for(source), completion, ground_truth))
        return self._score_entries(entries)

    def check_truths(self, items: Sequence[tuple[str, str]]) -> list[str | None]:
        """Check ``(ground_truth, data_source)`` items with their verifiers' ``check``, under the same
        wall-clock limit as scoring: None for a usable ground truth, else why not (one line). Sources
        without a verifier are checked by the fallback's (math); verifiers without a check pass all."""
        unique = list(dict.fromkeys((str(gt), str(src)) for gt, src in items))
        entries, index = [], {}
        for gt, src in unique:
            verifier = verifier_for(src)
            if verifier.check is None:
                continue
            index[(gt, src)] = len(entries)
            checker = Verifier(
                f"{verifier.name} ground truth", partial(_truth_verdict, verifier.check), verifier.in_process
            )
            entries.append((checker, "", gt))
        verdicts = self._score_entries(entries)
        reasons: dict[tuple[str, str], str | None] = {}
        for key, k in index.items():
            v = verdicts[k]
            if v.verdict is VerdictKind.CORRECT:
                reasons[key] = None
            elif v.verdict is VerdictKind.TIMEOUT:
                reasons[key] = (
                    f"the {key[1]} verifier could not read the ground truth {key[0]!r} within {self.timeout_s:g} s"
                )
            else:
                reasons[key] = v.detail or f"the {key[1]} verifier cannot read the ground truth {key[0]!r}"
        return [reasons.get((str(gt), str(src))) for gt, src in items]

    def _score_entries(self, entries: Sequence[tuple[Verifier, str, str]]) -> list[Verdict]:
        """Verdicts of ``(verifier, completion, ground_truth)`` entries, in order."""
        results: list[Verdict | None] = [None] * len(entries)
        pending: deque[tuple[int, bytes, str]] = deque()
        for i, (verifier, completion, ground_truth) in enumerate(entries):
            if verifier.in_process:
                results[i] = _run_verifier(verifier, completion, ground_truth)
                continue
            if self.max_chars is not None and isinstance(completion, str) and len(completion) > self.max_chars:
                results[i] = Verdict.of(
                    VerdictKind.ERROR,
                    detail=f"{verifier.name}: not scored: the completion has {len(completion)} characters, "
                    f"over the pool's limit of {self.max_chars} (max_chars)",
                )
                continue
            try:
                payload = bytes(ForkingPickler.dumps((verifier, completion, ground_truth)))
            except Exception as exc:
                results[i] = Verdict.of(
                    VerdictKind.ERROR,
                    detail=f"cannot send verifier {_qualified_name(verifier.fn)} to a worker ({exc!r}); "
                    "define it at module level in an importable module",
                )
                continue
            pending.append((i, payload, verifier.name))
        if pending:
            try:
                self._run(pending, results)
            except BaseException:
                # Ctrl-C or a failed start-up: busy workers would later answer for items of this
                # batch, so stop them all; the next batch starts fresh ones.
                self.close()
                raise
        done = [r for r in results if r is not None]
        if len(done) != len(entries):  # cannot happen: every branch above sets a verdict
            raise RuntimeError(f"internal error: {len(entries) - len(done)} items left without a verdict")
        return done

    # -- the dispatch loop

    def _run(self, pending: deque[tuple[int, bytes, str]], results: list[Verdict | None]) -> None:
        self._spawn_missing()
        names = {i: name for i, _, name in pending}
        while True:
            for slot, w in enumerate(self._workers):
                if w.ready and w.item is None and pending:
                    if not w.process.is_alive():  # died while idle
                        self._replace(slot)
                        continue
                    i, payload, _ = pending.popleft()
                    try:
                        w.conn.send_bytes(payload)
                    except OSError:  # broken pipe: it died just now; the item goes back to the queue
                        pending.appendleft((i, payload, names[i]))
                        self._replace(slot)
                        continue
                    w.item, w.deadline = i, time.monotonic() + self.timeout_s
            active = [w for w in self._workers if not w.ready or w.item is not None]
            if not pending and all(w.item is None for w in self._workers):
                return
            deadlines = [w.deadline if w.ready else w.started_at + self.startup_timeout_s for w in active]
            wait_s = max(0.0, min(deadlines) - time.monotonic())
            wait([w.conn for w in active] + [w.process.sentinel for w in active], timeout=wait_s)
            for slot in range(len(self._workers)):
                self._service(slot, results, names)

    def _spawn_missing(self) -> None:
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self._ctx, self.warmup))

    def _service(self, slot: int, results: list[Verdict | None], names: dict[int, str]) -> None:
        w = self._workers[slot]
        now = time.monotonic()
        if not w.ready:
            message = None
            if w.conn.poll():
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    message = None
            if message is not None:
                w.ready = True
            elif not w.process.is_alive() or now > w.started_at + self.startup_timeout_s:
                alive = w.process.is_alive()
                self.close()
                raise RuntimeError(
                    f"a verifier worker did not start within {self.startup_timeout_s:g} s"
                    if alive
                    else f"a verifier worker died while starting ({_exit_detail(w.process.exitcode)}); its "
                    "traceback is on stderr. Usual causes: the main script lacks an `if __name__ == '__main__':` "
                    "guard (spawn re-imports it), or `import coba_tasks.engines.verify, math_verify` fails here"
                )
            return
        if w.item is None:
            return
        i = w.item
        if w.conn.poll():
            try:
                verdict = w.conn.recv()
            except (EOFError, OSError):
                verdict = None
            if isinstance(verdict, Verdict):
                results[i] = verdict
                w.item, w.deadline = None, float("inf")
                return
        if not w.process.is_alive():
            w.process.join()
            detail = f"{names[i]}: worker process died while scoring ({_exit_detail(w.process.exitcode)})"
            logger.warning("verifier item %d: %s; starting a new worker", i, detail)
            results[i] = Verdict.of(VerdictKind.ERROR, detail=detail)
            self._replace(slot)
        elif now >= w.deadline:
            detail = f"{names[i]}: no verdict within {self.timeout_s:g} s; worker killed"
            logger.warning("verifier item %d: %s; starting a new worker", i, detail)
            results[i] = Verdict.of(VerdictKind.TIMEOUT, detail=detail)
            self._replace(slot)

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop(graceful=False)
        self._workers[slot] = _Worker(self._ctx, self.warmup)
        self.restarts += 1


def score_batch(
    items: Sequence[tuple[str, str, str]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    workers: int = DEFAULT_WORKERS,
) -> list[Verdict]:
    """Score a batch in a fresh ``VerifierPool`` (started only if some item needs it), then stop it.

    ``items``: ``(completion, ground_truth, data_source)``. Returns verdicts in the order of ``items``.
    A training loop should keep one ``VerifierPool`` instead, to start processes once.
    """
    with VerifierPool(workers=workers, timeout_s=timeout_s) as pool:
        return pool.score(items)
