"""Answer verification: turn (completion, ground truth, data_source) into a reward and a verdict.

The graders, run in the calling process: ``score`` picks a verifier by the row's ``data_source``
(``register_verifier``; an unknown source falls back to ``math``) and returns a ``Verdict``: reward 1.0 or
0.0 and one of five outcomes, counted apart so that a broken verifier never passes as a wrong answer
(``correct``, ``wrong``, ``no_answer``, ``timeout``, ``error``: the verifier raised or its worker died).
Scoring with a hard time limit per item, in worker processes, is ``coba_tasks.engines.verify_pool``; a
user's reward file replaces these verifiers (``coba_tasks.engines.reward_file``). Which verifier reads
which of veRL's sources, and how it differs from veRL's scorer: docs/design.md, "veRL datasets".

``math``: the ground truth is wrapped in ``\\boxed{}`` unless it already is; a DAPO line ``Answer: X``
(the last one) takes precedence, else math-verify's extraction stands (the *last* ``\\boxed{}`` wins;
boxes side by side, ``\\boxed{1}, \\boxed{2}``, read as the set ``{1, 2}``); then ``verify(gold, answer)``,
gold first (not symmetric). math-verify's own time limit (``signal.alarm``) works only in the main thread and
its ``TimeoutException`` escapes ``except Exception``, so it is switched off: the pool's limit is the one.
A ground truth math-verify cannot parse is an ``error`` (a data problem). An item takes 3-40 ms.

Custom verifiers: ``@register_verifier("my_source")`` on a module-level function
``(completion: str, ground_truth: str) -> Verdict``. Pool workers receive the function by reference
(pickle), so it must live in an importable module. ``in_process=True`` marks a verifier that is
cheap and cannot hang (``arith``: one regex): the pool scores it in the calling process.

Determinism: a verdict depends only on its item, except ``timeout``, which depends on the clock.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any, Literal, get_args


class VerdictKind(StrEnum):
    CORRECT = "correct"
    WRONG = "wrong"
    NO_ANSWER = "no_answer"
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of scoring one completion.

    ``reward`` is 1.0 exactly when ``verdict`` is ``correct`` (0.0 otherwise), except for a ``graded``
    verdict: a reward file's score (any finite number, ``correct`` when it reached the pass threshold,
    else ``wrong``; ``extra`` holds the other keys of the dict it returned). ``extracted_answer`` is the
    answer text the verifier read ("" if none); ``detail`` explains errors, timeouts and odd cases.
    """

    reward: float
    verdict: VerdictKind
    extracted_answer: str = ""
    detail: str = ""
    graded: bool = False
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.verdict, VerdictKind):
            object.__setattr__(self, "verdict", VerdictKind(self.verdict))
        if self.graded:
            if self.verdict not in (VerdictKind.CORRECT, VerdictKind.WRONG) or not math.isfinite(self.reward):
                raise ValueError(
                    f"a graded verdict is correct or wrong with a finite reward, got {self.verdict.value!r} "
                    f"with {self.reward}; build it with Verdict.graded_score(reward, passed)"
                )
            return
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

    @classmethod
    def graded_score(
        cls, reward: float, passed: bool, extra: Iterable[tuple[str, Any]] = (), detail: str = ""
    ) -> Verdict:
        """A reward function's score: ``correct`` when ``passed`` (the pass threshold), else ``wrong``."""
        kind = VerdictKind.CORRECT if passed else VerdictKind.WRONG
        return cls(float(reward), kind, "", detail, graded=True, extra=tuple(extra))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, one row of ``rewards.parquet``: reward, verdict, extracted_answer, detail, and the
        extra keys of a reward function's dict."""
        row = {"reward": self.reward, "verdict": self.verdict.value, "extracted_answer": self.extracted_answer}
        return {**row, "detail": self.detail, **dict(self.extra)}


def solved(rewards: Any) -> Any:
    """Per row of a rewards table (a pandas frame with a ``verdict`` column): whether the rollout solved its
    prompt, its verdict ``correct``. The one definition of solved: pass rates, the allocator's history, the
    held-out accuracy and the mechanisms all count it (a reward file's ``correct`` is a score of at least
    ``verify.pass_threshold``)."""
    return rewards["verdict"].astype(str) == str(VerdictKind.CORRECT)


def count_verdicts(verdicts: Iterable[Verdict | str]) -> dict[str, int]:
    """Count verdicts (``Verdict`` objects or their kinds as strings) by kind; every kind is a key, in order.

    >>> count_verdicts([Verdict.of("correct"), Verdict.of("wrong"), Verdict.of("correct")])
    {'correct': 2, 'wrong': 1, 'no_answer': 0, 'timeout': 0, 'error': 0}
    >>> count_verdicts(["timeout", "correct"])["timeout"]
    1
    """
    counts = {kind.value: 0 for kind in VerdictKind}
    for v in verdicts:
        counts[v.verdict.value if isinstance(v, Verdict) else str(v)] += 1
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
# verify.gsm8k_answer: math-verify over the whole text, or veRL's GSM8K scorer in that mode
Gsm8kAnswer = Literal["math", "strict", "flexible"]
GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")  # the data_source values verify.gsm8k_answer applies to


def register_verifier(
    name: str, *aliases: str, in_process: bool = False, check: TruthCheck | None = None
) -> Callable[[VerifierFn], VerifierFn]:
    """Decorator: register ``fn`` as the verifier for ``name`` and each alias (data_source values); ``fn`` is
    returned unchanged (importable by reference from workers), and registering it again is a no-op.

    ``check`` (a module-level function) is called on every ground truth of a dataset when it loads and raises
    ``ValueError`` for one ``fn`` cannot score against: such a row is a bad row (``data.on_bad_rows``).
    """

    def decorator(fn: VerifierFn) -> VerifierFn:
        entry = Verifier(name=name, fn=fn, in_process=in_process, check=check)
        for key in (name, *aliases):
            old = _REGISTRY.get(key)
            if old is not None and qualified_name(old.fn) != qualified_name(fn):
                raise ValueError(
                    f"data_source {key!r} already has the verifier {qualified_name(old.fn)}; "
                    f"register {qualified_name(fn)} under another name"
                )
            _REGISTRY[key] = entry
        return fn

    return decorator


def registered_verifiers() -> tuple[str, ...]:
    """All data_source names with a verifier, sorted."""
    return tuple(sorted(_REGISTRY))


def verifier_for(data_source: str, *, fallback: bool = True, gsm8k_answer: Gsm8kAnswer = "math") -> Verifier:
    """The verifier for ``data_source``; unknown sources get the ``math`` verifier unless ``fallback=False``.
    ``gsm8k_answer`` (``verify.gsm8k_answer``) picks the verifier of ``GSM8K_SOURCES`` (``gsm8k_verifier``)."""
    if gsm8k_answer != "math" and data_source in GSM8K_SOURCES:
        return gsm8k_verifier(gsm8k_answer)
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


def verifier_modules() -> set[str]:
    """The modules of every registered verifier's function (pool workers import them before taking items)."""
    return {v.fn.__module__ for v in _REGISTRY.values()}


def qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a verifier function, for messages."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --------------------------------------------------------------------------- scoring in this process


def score(completion: str, ground_truth: str, data_source: str = FALLBACK_SOURCE) -> Verdict:
    """Score one completion in this process, with no time limit (``VerifierPool`` for untrusted text); never
    raises for a bad completion or ground truth: exceptions become ``error`` verdicts.

    >>> score("95 and more text", "95", "arith").verdict.value
    'correct'
    >>> score("  -7", "7", "arith").to_dict()
    {'reward': 0.0, 'verdict': 'wrong', 'extracted_answer': '-7', 'detail': ''}
    """
    return run_verifier(verifier_for(data_source), completion, ground_truth)


def run_verifier(verifier: Verifier, completion: str, ground_truth: Any) -> Verdict:
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
    """The arithmetic task asked of a chat model ("Compute 9-7. End your reply with the final answer."):
    the last integer of the text that is not the right operand of an operator (in "9-7" or "9 - 7" the
    7 is an operand, in "9 - 7 = 2" the 2 is not); a completion that boxes its answer is read by its
    last ``\\boxed{}`` instead (files worded for math prompts ask for one). The answer to "Compute 9-7"
    is a number: a box holding an expression (``\\boxed{9-7}``) is ``wrong``, and so is the question
    written back. math-verify, which evaluates expressions, scored both as correct, and a model trained
    on it learned to echo the question."""
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


for _name in ("math_verify.parser", "math_verify.grader"):  # its warning that its timeouts are off: we time items out
    logging.getLogger(_name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))


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


# --------------------------------------------------------------------------- veRL's GSM8K scorer

# veRL reads only the last 300 characters of a completion (a speed-up that also decides which answers it sees)
GSM8K_TAIL_CHARS = 300
_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")  # "#### " then a number: digits, '.' and ',' in any order
_GSM8K_NUMBER = re.compile(r"-?[0-9.,]+")


def _gsm8k_verdict(answer: str | None, ground_truth: str, missing: str) -> Verdict:
    """veRL's comparison: the extracted text equal to the ground truth, character for character."""
    if answer is None:
        return Verdict.of(VerdictKind.NO_ANSWER, detail=missing)
    return Verdict.of(VerdictKind.CORRECT if answer == ground_truth else VerdictKind.WRONG, answer)


def gsm8k_strict_verifier(completion: str, ground_truth: str) -> Verdict:
    """veRL's GSM8K scorer, strict mode (its default): in the last 300 characters of the completion, the
    number after the last ``#### `` (one space), commas removed, compared with the ground
    truth as text (``72.0`` is not ``72``). No ``#### <number>`` there is ``no_answer``."""
    found = _GSM8K_STRICT.findall(completion[-GSM8K_TAIL_CHARS:])
    answer = found[-1].replace(",", "") if found else None
    return _gsm8k_verdict(answer, ground_truth, 'no "#### <number>" in the last 300 characters')


def gsm8k_flexible_verifier(completion: str, ground_truth: str) -> Verdict:
    """veRL's GSM8K scorer, flexible mode: the last run of digits, ``.`` and ``,`` (optional ``-``) in the
    last 300 characters that is not just ``.``, compared with the ground truth as text, commas and a
    final full stop kept as veRL keeps them (``1,000`` and ``72.`` are ``wrong`` against ``1000`` and
    ``72``). No number there is ``no_answer``."""
    found = [n for n in _GSM8K_NUMBER.findall(completion[-GSM8K_TAIL_CHARS:]) if n not in ("", ".")]
    return _gsm8k_verdict(found[-1] if found else None, ground_truth, "no number in the last 300 characters")


_GSM8K_VERIFIERS = {
    "strict": Verifier("gsm8k_strict", gsm8k_strict_verifier, in_process=True, check=math_truth),
    "flexible": Verifier("gsm8k_flexible", gsm8k_flexible_verifier, in_process=True, check=math_truth),
}


def gsm8k_verifier(mode: Gsm8kAnswer) -> Verifier:
    """The verifier of the GSM8K sources under ``verify.gsm8k_answer=mode``; ValueError for an unknown mode."""
    if mode == "math":
        return _REGISTRY["openai/gsm8k"]
    if mode not in _GSM8K_VERIFIERS:
        raise ValueError(f"verify.gsm8k_answer must be one of {', '.join(get_args(Gsm8kAnswer))}, got {mode!r}")
    return _GSM8K_VERIFIERS[mode]
