"""Tests for coba_tasks.engines.verify (the arith and math verifiers, the registry) and
coba_tasks.engines.verify_pool (the process pool).

The pool tests use verifiers registered below (``test_hang``, ``test_crash``, ...). They are
module-level functions, so a worker process receives them by reference and imports this module.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import coba_tasks.engines.verify_pool as verify_pool_module
from coba_tasks.engines.verify import (
    Verdict,
    VerdictKind,
    count_verdicts,
    register_verifier,
    registered_verifiers,
    score,
    verifier_for,
)
from coba_tasks.engines.verify_pool import VerifierPool, score_batch

CORRECT, WRONG, NO_ANSWER, TIMEOUT, ERROR = (k.value for k in VerdictKind)


@register_verifier("test_hang")
def _hang(completion: str, ground_truth: str) -> Verdict:
    while True:
        time.sleep(1.0)


@register_verifier("test_crash")
def _crash(completion: str, ground_truth: str) -> Verdict:
    os._exit(3)


@register_verifier("test_sigkill")
def _sigkill(completion: str, ground_truth: str) -> Verdict:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


@register_verifier("test_segfault")
def _segfault(completion: str, ground_truth: str) -> Verdict:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    raise AssertionError("unreachable")


@register_verifier("test_raise")
def _raise(completion: str, ground_truth: str) -> Verdict:
    raise RuntimeError("verifier bug")


class _NotAnException(BaseException):
    """Like math-verify's TimeoutException: a BaseException that `except Exception` misses."""


@register_verifier("test_base_exception")
def _base_exception(completion: str, ground_truth: str) -> Verdict:
    raise _NotAnException("escaped except Exception")


@register_verifier("test_bad_return")
def _bad_return(completion: str, ground_truth: str) -> Verdict:
    return 1.0  # type: ignore[return-value]


@register_verifier("test_interrupt")
def _interrupt(completion: str, ground_truth: str) -> Verdict:
    raise KeyboardInterrupt


def _kinds(verdicts: list[Verdict]) -> list[str]:
    return [v.verdict.value for v in verdicts]


# --------------------------------------------------------------------------- arith


# (completion, ground truth, verdict, extracted answer)
ARITH_CASES = [
    ("95", "95", CORRECT, "95"),
    ("96", "95", WRONG, "96"),
    ("95</s>", "95", CORRECT, "95"),  # end text after the number is ignored
    ("  95\n37+1=38", "95", CORRECT, "95"),  # leading whitespace, then another problem
    ("-12", "-12", CORRECT, "-12"),
    ("12", "-12", WRONG, "12"),
    ("-12", "12", WRONG, "-12"),
    ("007", "7", CORRECT, "007"),
    ("95.5", "95", WRONG, "95.5"),  # a fractional part is not an integer answer
    ("", "95", NO_ANSWER, ""),
    ("the answer is 95", "95", NO_ANSWER, ""),  # the integer must come first
    ("- 95", "-95", NO_ANSWER, ""),
]


def test_arith_bad_ground_truth_is_an_error_not_wrong() -> None:
    v = score("95", "ninety-five", "arith")
    assert v.verdict is VerdictKind.ERROR
    assert "ninety-five" in v.detail


@given(answer=st.integers(-(10**12), 10**12), delta=st.integers(-50, 50), tail=st.sampled_from(["", "</s>", "\n1+1=2"]))
def test_arith_property(answer: int, delta: int, tail: str) -> None:
    v = score(f"{answer + delta}{tail}", str(answer), "arith")
    assert v.verdict is (VerdictKind.CORRECT if delta == 0 else VerdictKind.WRONG)
    assert int(v.extracted_answer) == answer + delta


# --------------------------------------------------------------------------- arith_chat


ARITH_CHAT_CASES = [
    ("\\boxed{2}", "2", CORRECT, "2"),
    ("8-6 = \\boxed{ 2 }.", "2", CORRECT, "2"),
    ("So 46-90 = -44.", "-44", CORRECT, "-44"),  # the last integer, sentence end and all
    ("To compute 6+7, we add them: 6 + 7 = 13", "13", CORRECT, "13"),
    ("the sum is 1,538 in all", "1538", CORRECT, "1,538"),
    ("\\boxed{3} or rather \\boxed{2}", "2", CORRECT, "2"),  # the last box
    ("\\boxed{2}, and then 7", "2", CORRECT, "2"),  # a box wins over later numbers
    # the question written back is not its answer (math-verify evaluated it: 9-7 -> 2, correct)
    ("9-7", "2", WRONG, "9"),
    ("The answer is 9-7", "2", WRONG, "9"),
    ("4-2", "2", WRONG, "4"),  # an echo whose last operand is the answer
    ("4 - 2", "2", WRONG, "4"),
    ("4 - 2 = 2", "2", CORRECT, "2"),
    ("\\boxed{9-7}", "2", WRONG, "9-7"),
    ("8-6 = 3", "2", WRONG, "3"),
    ("2.5", "2", NO_ANSWER, ""),  # no integer
    ("I cannot say.", "2", NO_ANSWER, ""),
]


@pytest.mark.parametrize(
    ("verifier", "completion", "truth", "kind", "extracted"),
    [("arith", *case) for case in ARITH_CASES] + [("arith_chat", *case) for case in ARITH_CHAT_CASES],
)
def test_integer_verifiers(verifier: str, completion: str, truth: str, kind: str, extracted: str) -> None:
    v = score(completion, truth, verifier)
    assert (v.verdict.value, v.extracted_answer) == (kind, extracted)
    assert v.reward == (1.0 if kind == CORRECT else 0.0)


def test_math_verify_scores_the_question_written_back_as_its_answer() -> None:
    """Why the arithmetic chat files name arith_chat: math-verify evaluates an expression it finds."""
    assert score("9-7", "2", "math").verdict is VerdictKind.CORRECT
    assert score("9-7", "2", "arith_chat").verdict is VerdictKind.WRONG


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "truth", "kind"),
    [
        ("so the probability is $\\boxed{0.5}$.", "\\frac{1}{2}", CORRECT),
        ("so the probability is $\\boxed{\\frac{1}{2}}$.", "0.5", CORRECT),
        ("$\\boxed{\\frac12}$", "1/2", CORRECT),
        ("$\\boxed{0.51}$", "\\frac{1}{2}", WRONG),
        ("The side is $\\boxed{\\sqrt{8}}$.", "2\\sqrt{2}", CORRECT),
        ("The side is $\\boxed{2\\sqrt{2}}$.", "\\sqrt{8}", CORRECT),
        ("The side is $\\boxed{\\sqrt{7}}$.", "\\sqrt{8}", WRONG),
        ("$\\boxed{5}$", "\\boxed{5}", CORRECT),  # a ground truth already boxed is not boxed twice
        ("$\\boxed{5}$", "$5$", CORRECT),
        ("We get $x = 3$, so the answer is $\\boxed{3}$.", "3", CORRECT),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", CORRECT),  # gsm8k style: the last number
    ],
)
def test_math_equivalences(completion: str, truth: str, kind: str) -> None:
    v = score(completion, truth, "math")
    assert v.verdict.value == kind, v
    assert v.extracted_answer != ""


def test_math_several_boxed_answers_the_last_one_counts() -> None:
    # math-verify reads matches from the right: with two separate boxes the last one is the answer.
    text = "A first guess is $\\boxed{3}$. Checking again, the answer is $\\boxed{5}$."
    assert score(text, "5").verdict is VerdictKind.CORRECT
    last = score(text, "3")
    assert (last.verdict, last.extracted_answer) == (VerdictKind.WRONG, "5")
    # Boxes written side by side ("," / "and") are read together as one set answer.
    pair = score("The roots are $\\boxed{1}$ and $\\boxed{2}$.", "1, 2")
    assert pair.verdict is VerdictKind.CORRECT
    assert score("The roots are $\\boxed{1}$ and $\\boxed{2}$.", "2").verdict is VerdictKind.WRONG


def test_math_dapo_answer_line() -> None:
    v = score("Let me compute 6 * 7 step by step.\nAnswer: 42", "42", "math_dapo")
    assert (v.verdict, v.extracted_answer) == (VerdictKind.CORRECT, "42")
    assert score("Work...\nAnswer: $\\frac{1}{2}$", "0.5", "math_dapo").verdict is VerdictKind.CORRECT
    assert score("Work...\n**Answer:** 41", "42", "math_dapo").verdict is VerdictKind.WRONG
    # The final "Answer:" line wins over an earlier box (math-verify alone would take the box).
    boxed_then_line = "First try: $\\boxed{7}$. That was wrong.\nAnswer: 42"
    assert score(boxed_then_line, "42", "math_dapo").verdict is VerdictKind.CORRECT
    assert score(boxed_then_line, "7", "math_dapo").verdict is VerdictKind.WRONG


@pytest.mark.parametrize("completion", ["", "I do not know how to solve this.", "$$", "\\boxed{}"])
def test_math_no_answer(completion: str) -> None:
    v = score(completion, "42", "math")
    assert v.verdict is VerdictKind.NO_ANSWER
    assert v.reward == 0.0


def test_math_unparsable_answer_is_no_answer_with_its_text() -> None:
    v = score("so it is \\boxed{\\frac{1}{2", "0.5", "math")  # unbalanced braces
    assert v.verdict is VerdictKind.NO_ANSWER
    assert v.extracted_answer != ""


def test_math_unparsable_ground_truth_is_an_error() -> None:
    v = score("$\\boxed{1}$", "", "math")
    assert v.verdict is VerdictKind.ERROR
    assert "ground truth" in v.detail


# --------------------------------------------------------------------------- errors, registry, Verdict


def test_exceptions_become_errors_with_detail() -> None:
    v = score("x", "1", "test_raise")
    assert (v.verdict, v.reward) == (VerdictKind.ERROR, 0.0)
    assert "RuntimeError: verifier bug" in v.detail
    base = score("x", "1", "test_base_exception")
    assert base.verdict is VerdictKind.ERROR and "_NotAnException" in base.detail
    bad = score("x", "1", "test_bad_return")
    assert bad.verdict is VerdictKind.ERROR and "not Verdict" in bad.detail
    assert score(None, "1", "arith").verdict is VerdictKind.ERROR  # type: ignore[arg-type]


def test_keyboard_interrupt_is_not_swallowed() -> None:
    with pytest.raises(KeyboardInterrupt):
        score("x", "1", "test_interrupt")


def test_registry() -> None:
    names = registered_verifiers()
    assert {"arith", "math", "math_dapo", "lighteval/MATH", "openai/gsm8k", "aime"} <= set(names)
    assert verifier_for("math_dapo").name == "math"
    assert verifier_for("some/unknown-dataset").name == "math"  # the fallback
    assert verifier_for("arith").in_process and not verifier_for("math").in_process
    with pytest.raises(KeyError, match="arith"):
        verifier_for("some/unknown-dataset", fallback=False)
    with pytest.raises(ValueError, match="already has the verifier"):
        register_verifier("arith")(_raise)
    register_verifier("test_hang")(_hang)  # the same function again: a no-op
    assert verifier_for("test_hang").fn is _hang


def test_verdict_dict_and_consistency() -> None:
    v = Verdict.of("correct", "42")
    assert v.to_dict() == {"reward": 1.0, "verdict": "correct", "extracted_answer": "42", "detail": ""}
    with pytest.raises(ValueError, match="must have reward"):
        Verdict(1.0, VerdictKind.WRONG)


def test_count_verdicts() -> None:
    verdicts = [Verdict.of(k) for k in (CORRECT, CORRECT, WRONG, TIMEOUT, ERROR, ERROR, ERROR)]
    assert count_verdicts(verdicts) == {"correct": 2, "wrong": 1, "no_answer": 0, "timeout": 1, "error": 3}
    assert count_verdicts([]) == dict.fromkeys(("correct", "wrong", "no_answer", "timeout", "error"), 0)


# --------------------------------------------------------------------------- the pool

MIXED = [
    ("$\\boxed{0.5}$", "\\frac{1}{2}", "math"),
    ("95", "95", "arith"),
    ("$\\boxed{\\sqrt{7}}$", "\\sqrt{8}", "lighteval/MATH"),
    ("I give up.", "3", "math"),
    ("-4</s>", "4", "arith"),
    ("Answer: 42", "42", "math_dapo"),
    ("$\\boxed{1}$", "", "math"),
]


def test_score_batch_matches_in_process_scoring_in_order() -> None:
    expected = [score(*item) for item in MIXED]
    assert _kinds(expected) == [CORRECT, CORRECT, WRONG, NO_ANSWER, WRONG, CORRECT, ERROR]
    assert score_batch(MIXED, timeout_s=10.0, workers=2) == expected


def test_arith_only_batch_starts_no_process() -> None:
    items = [(str(a + b), str(a + b), "arith") for a in range(30) for b in range(30)]
    with VerifierPool(workers=2) as pool:
        verdicts = pool.score(items)
        assert pool.worker_pids == []
    assert count_verdicts(verdicts)["correct"] == len(items)


def test_bad_items_and_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="expected \\(completion, ground_truth, data_source\\)"):
        VerifierPool().score([("95", "95")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="workers"):
        VerifierPool(workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(timeout_s=0)
    with pytest.raises(ValueError, match="max_chars"):
        VerifierPool(max_chars=0)


def _boxed_integers(n: int, offset: int) -> list[tuple[str, str, str]]:
    """Cheap math items (no slow sympy simplification), correct iff offset == 0."""
    return [(f"$\\boxed{{{k}}}$", str(k + offset), "math") for k in range(n)]


@pytest.fixture(scope="module")
def pool():
    # A 1.5 s limit keeps the tests short; items in the pool tests are cheap so that they stay far
    # below it even on a loaded machine (a first sympy simplification can take 0.5 s on its own).
    with VerifierPool(workers=2, timeout_s=1.5) as p:
        yield p.start()  # started here, so worker start-up time stays out of the timed batches


def test_pool_timeout_kills_the_item_and_the_batch_goes_on(pool: VerifierPool) -> None:
    items = [
        ("anything", "1", "test_hang"),  # sleeps for ever
        *_boxed_integers(8, offset=0),
        ("7", "7", "arith"),
    ]
    pool.start()
    restarts = pool.restarts
    before = set(pool.worker_pids)
    verdicts = pool.score(items)
    assert _kinds(verdicts) == [TIMEOUT] + [CORRECT] * 9
    # the verdict records the pool's hard limit, and that the stuck worker was killed for it
    assert verdicts[0].detail == "test_hang: no verdict within 1.5 s; worker killed"
    assert verdicts[0].reward == 0.0
    assert pool.restarts == restarts + 1
    # Exactly one worker was replaced: the stuck one. The other lived through the batch and
    # scored everything else meanwhile.
    after = set(pool.worker_pids)
    assert len(after) == 2 and len(before & after) == 1 and len(after - before) == 1


def test_pool_timeout_on_a_real_math_input(pool: VerifierPool) -> None:
    # sympy never finishes comparing 9^(9^(9^9)) with 5 (math-verify's own timeout is off in workers).
    items = [("$\\boxed{9^{9^{9^{9}}}}$", "5", "math"), *_boxed_integers(6, offset=0)]
    restarts = pool.restarts
    verdicts = pool.score(items)
    assert _kinds(verdicts) == [TIMEOUT] + [CORRECT] * 6
    assert pool.restarts == restarts + 1


def test_pool_crashed_worker_gives_error_and_pool_recovers(pool: VerifierPool) -> None:
    items = [
        ("$\\boxed{3}$", "3", "math"),
        ("x", "1", "test_crash"),  # os._exit(3)
        ("$\\boxed{4}$", "4", "math"),
        ("x", "1", "test_segfault"),
        *_boxed_integers(4, offset=1),
        ("x", "1", "test_raise"),  # an exception, not a crash: the worker lives on
    ]
    restarts = pool.restarts
    verdicts = pool.score(items)
    assert _kinds(verdicts) == [CORRECT, ERROR, CORRECT, ERROR] + [WRONG] * 4 + [ERROR]
    assert "exit code 3" in verdicts[1].detail
    assert "SIGSEGV" in verdicts[3].detail
    assert "verifier bug" in verdicts[8].detail
    assert pool.restarts == restarts + 2
    assert _kinds(pool.score(_boxed_integers(4, offset=0))) == [CORRECT] * 4


def test_pool_interrupted_mid_batch_stops_its_workers(pool: VerifierPool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Busy workers of an interrupted batch would answer for its items later: the pool drops them.
    pool.start()

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_pool_module, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.score(_boxed_integers(4, offset=0))
    assert pool.worker_pids == []
    monkeypatch.undo()
    assert _kinds(pool.score(_boxed_integers(4, offset=1))) == [WRONG] * 4  # fresh workers, right answers


def test_pool_reports_a_verifier_it_cannot_send() -> None:
    def local_verifier(completion: str, ground_truth: str) -> Verdict:  # not importable by a worker
        return Verdict.of("correct")

    register_verifier("test_local")(local_verifier)
    with VerifierPool(workers=1) as pool:
        verdicts = pool.score([("x", "1", "test_local"), ("5", "5", "arith")])
    assert _kinds(verdicts) == [ERROR, CORRECT]
    assert "module level" in verdicts[0].detail


# --------------------------------------------------------------------------- hostile inputs

# Both run for minutes in sympy / math-verify when scored in-process (measured: nesting 5000 deep
# did not finish in 60 s; a box of 10^6 digits takes ~15 s), so only the wall-clock limit stops them.
DEEP_LATEX = "$\\boxed{" + "\\frac{1}{" * 5000 + "2" + "}" * 5000 + "}$"
BIG_BOX = "$\\boxed{" + "1" * 999_000 + "}$"  # ~1 MB, just under the pool's default max_chars
HUGE = "$\\boxed{" + "1" * 1_000_000 + "}$"  # over max_chars: refused without parsing


def test_pool_cuts_off_deep_latex_and_a_megabyte_answer_and_scores_the_rest(pool: VerifierPool) -> None:
    items = [
        (DEEP_LATEX, "5", "math"),
        *_boxed_integers(3, offset=0),
        (HUGE, "5", "math"),
        (BIG_BOX, "5", "math"),
        *_boxed_integers(3, offset=1),
        ("7", "7", "arith"),
    ]
    restarts = pool.restarts
    verdicts = pool.score(items)
    kinds = _kinds(verdicts)
    assert kinds[0] in (TIMEOUT, ERROR), verdicts[0]  # cut at 1.5 s, or a crash (C stack) if it explodes
    assert kinds[1:4] == [CORRECT] * 3
    assert kinds[4] == ERROR and "over the pool's limit of 1000000" in verdicts[4].detail
    assert kinds[5] == TIMEOUT and "no verdict within 1.5 s" in verdicts[5].detail
    assert kinds[6:] == [WRONG] * 3 + [CORRECT]
    assert [verdicts[i].reward for i in (0, 4, 5)] == [0.0, 0.0, 0.0]
    assert count_verdicts(verdicts)["timeout"] >= 1
    # nothing ran to its end (each alone runs for minutes or ~15 s): both stuck workers were cut
    # off by the pool and replaced, and the refused item cost none
    assert pool.restarts == restarts + 2
    assert _kinds(pool.score(_boxed_integers(4, offset=0))) == [CORRECT] * 4  # the pool still works


def test_size_guard_can_be_switched_off_and_spares_in_process_verifiers() -> None:
    with VerifierPool(workers=1, max_chars=10) as small:
        verdicts = small.score([("$\\boxed{12345678}$", "1", "math"), ("5" + " " * 100, "5", "arith")])
        assert small.worker_pids == []  # the refused item never started a worker
    assert _kinds(verdicts) == [ERROR, CORRECT]
    assert "18 characters, over the pool's limit of 10" in verdicts[0].detail
    assert VerifierPool(max_chars=None).max_chars is None


def test_pool_worker_killed_inside_an_item_or_while_idle_is_replaced(pool: VerifierPool) -> None:
    pool.start()
    restarts = pool.restarts
    verdicts = pool.score([("x", "1", "test_sigkill"), *_boxed_integers(3, offset=0)])
    assert _kinds(verdicts) == [ERROR] + [CORRECT] * 3
    assert "killed by SIGKILL" in verdicts[0].detail
    assert pool.restarts == restarts + 1
    # Both workers killed from outside between two batches (the OOM killer, an operator).
    pool.start()
    for w in pool._workers:
        os.kill(w.process.pid, signal.SIGKILL)
        w.process.join(timeout=10)
    assert _kinds(pool.score(_boxed_integers(4, offset=1))) == [WRONG] * 4
    assert pool.restarts == restarts + 3


def test_reward_table_records_timeouts_in_its_verdict_column(pool: VerifierPool) -> None:
    from coba_tasks.pipeline import stages

    prompts = pd.DataFrame({"prompt_id": ["a", "b"], "ground_truth": ["3", "1"], "data_source": ["math", "test_hang"]})
    rollouts = pd.DataFrame(
        {"prompt_id": ["a", "a", "b"], "sample_idx": [0, 1, 0], "completion": ["$\\boxed{3}$", "$\\boxed{4}$", "x"]}
    )
    table = stages.reward_table(rollouts, prompts, pool)
    assert table["verdict"].tolist() == [CORRECT, WRONG, TIMEOUT]
    assert table["reward"].tolist() == [1.0, 0.0, 0.0]
    assert count_verdicts(table["verdict"]) == {
        "correct": 1,
        "wrong": 1,
        "no_answer": 0,
        "timeout": 1,
        "error": 0,
    }


# --------------------------------------------------------------------------- properties: score never raises

KINDS = {k.value for k in VerdictKind}
LATEXISH = st.lists(
    st.sampled_from(
        [
            "\\boxed{",
            "\\frac{",
            "\\sqrt",
            "\\left(",
            "\\right)",
            "{",
            "}",
            "^",
            "_",
            "$",
            "$$",
            "\\",
            "=",
            "+",
            "-",
            "*",
            "/",
            "1",
            "2",
            "0.5",
            "x",
            "\\pi",
            "\\infty",
            "\\cdot",
            "\\text{",
            ",",
            " ",
            "\n",
            "Answer:",
            "\\begin{pmatrix}",
            "\\end{pmatrix}",
            "&",
            "%",
            "#",
        ]
    ),
    max_size=40,
).map("".join)


def _check_verdict(v: Verdict) -> None:
    assert isinstance(v, Verdict)
    assert v.verdict.value in KINDS
    assert v.reward == (1.0 if v.verdict is VerdictKind.CORRECT else 0.0)
    assert isinstance(v.extracted_answer, str) and isinstance(v.detail, str)


@given(completion=st.one_of(st.text(), LATEXISH), truth=st.one_of(st.integers().map(str), st.text(max_size=20)))
def test_score_arith_never_raises(completion: str, truth: str) -> None:
    _check_verdict(score(completion, truth, "arith"))


@settings(max_examples=30, deadline=None)
@given(
    completion=st.one_of(st.text(max_size=200), LATEXISH),
    truth=st.one_of(st.sampled_from(["5", "\\frac{1}{2}", "x^2", "\\sqrt{2}", "(1, 2)"]), LATEXISH),
)
def test_score_math_through_the_pool_never_raises(pool: VerifierPool, completion: str, truth: str) -> None:
    # Untrusted text goes through the pool (a worker may hang on it: then it is a `timeout`).
    verdicts = pool.score([(completion, truth, "math"), ("$\\boxed{2}$", "2", "math")])
    _check_verdict(verdicts[0])
    assert verdicts[1].verdict is VerdictKind.CORRECT


# --------------------------------------------------------------------------- veRL datasets (tests/verl_files.py)

GSM8K_CASES = [  # completion, ground truth, verdict under math / strict / flexible
    ("3 + 4 = 7 apples.\n#### 7", "7", ("correct", "correct", "correct")),
    ("The total is 7.", "7", ("correct", "no_answer", "wrong")),  # flexible reads "7." (veRL keeps the '.')
    ("So he has 7 apples", "7", ("correct", "no_answer", "correct")),
    ("#### 8", "7", ("wrong", "wrong", "wrong")),
    ("#### 1,200", "1200", ("correct", "correct", "wrong")),  # flexible keeps the comma
    ("#### 5\nno, wait: #### 7", "7", ("correct", "correct", "correct")),  # the last "####"
    ("####7", "7", ("no_answer", "no_answer", "correct")),  # strict wants one space after "####"
    ("no idea", "7", ("no_answer", "no_answer", "no_answer")),
]


@pytest.mark.parametrize(("completion", "truth", "want"), GSM8K_CASES)
def test_gsm8k_answer_modes_score_as_documented(completion, truth, want):
    from coba_tasks.engines.verify import run_verifier, verifier_for

    got = tuple(
        run_verifier(verifier_for("openai/gsm8k", gsm8k_answer=mode), completion, truth).verdict.value
        for mode in ("math", "strict", "flexible")
    )
    assert got == want


def test_strict_gsm8k_reads_only_the_last_300_characters_as_verl_does():
    from coba_tasks.engines.verify import gsm8k_strict_verifier

    assert gsm8k_strict_verifier("#### 7" + " pad" * 80, "7").verdict is VerdictKind.NO_ANSWER
    assert gsm8k_strict_verifier(" pad" * 80 + "#### 7", "7").verdict is VerdictKind.CORRECT


def test_gsm8k_answer_applies_to_gsm8k_sources_only():
    from coba_tasks.engines.verify import verifier_for

    assert verifier_for("gsm8k", gsm8k_answer="strict").name == "gsm8k_strict"
    assert verifier_for("lighteval/MATH", gsm8k_answer="strict").name == "math"
    assert verifier_for("openai/gsm8k").name == "math"
    with pytest.raises(ValueError, match=r"verify\.gsm8k_answer must be one of math, strict, flexible"):
        VerifierPool(gsm8k_answer="loose")  # type: ignore[arg-type]


def test_verl_files_load_and_score_in_the_pool(tmp_path):
    from verl_files import write_verl_gsm8k, write_verl_math

    from coba_tasks.pipeline.data import load_dataset

    gsm = load_dataset(write_verl_gsm8k(tmp_path / "g.parquet", [("Q1?", "7"), ("Q2?", "1200")]))
    math_df = load_dataset(write_verl_math(tmp_path / "m.parquet", [("P1?", "\\frac{3}{4}"), ("P2?", "8")]))
    (g7, s7), (g1200, s1200) = zip(gsm["ground_truth"], gsm["data_source"], strict=True)
    (m34, ms), (m8, _) = zip(math_df["ground_truth"], math_df["data_source"], strict=True)
    gsm_items = [
        ("#### 7", g7, s7),
        ("the answer is 7", g7, s7),
        ("#### 1,200", g1200, s1200),
        ("#### 12", g1200, s1200),
    ]
    math_items = [("so \\boxed{\\frac{3}{4}}", m34, ms), ("\\boxed{0.75}", m34, ms), ("\\boxed{9}", m8, ms)]
    with VerifierPool(workers=1, timeout_s=20.0, gsm8k_answer="strict") as pool:
        strict = [v.verdict.value for v in pool.score(gsm_items)]
        assert pool.worker_pids == []  # veRL's GSM8K scorer runs in this process
        maths = [v.verdict.value for v in pool.score(math_items)]
    assert strict == ["correct", "no_answer", "correct", "wrong"]
    assert maths == ["correct", "correct", "wrong"]
    with VerifierPool(workers=1, timeout_s=20.0, gsm8k_answer="flexible") as pool:
        assert [v.verdict.value for v in pool.score(gsm_items)] == ["correct", "correct", "wrong", "wrong"]
