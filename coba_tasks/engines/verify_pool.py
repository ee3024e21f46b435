"""The verifier pool: ``coba_tasks.engines.verify``'s graders (or a reward file, ``coba_tasks.engines.reward_file``)
run in worker processes with a hard wall-clock limit per item (docs/design.md, "Components").

Why processes: math-verify's own time limit (``signal.alarm``) works only in the main thread, and some answers
make sympy run for ever (``\\boxed{9^{9^{9^{9}}}}`` against ``5``; deeply nested LaTeX, a megabyte-long box of
digits). A stuck worker is killed and replaced and its item scored ``timeout``; a worker that dies gives its
item ``error``; the rest of the batch goes on. A completion over ``max_chars`` is scored ``error`` without
reaching a worker. Verifiers registered ``in_process`` (``arith``) are scored in the calling process.

A reward file: workers receive its path and function name, never the function, and import it when they start,
under the per-item limit (past it, the batch stops with one ``RewardFileError``); ``check_reward_function`` is
that import, made before a run starts. ``spawn`` re-imports the main script in each worker, so a script that
scores batches needs an ``if __name__ == "__main__":`` guard. A round trip costs about 1 ms per item.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from functools import partial
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

from coba_tasks.engines.reward_file import KEY as REWARD_KEY
from coba_tasks.engines.reward_file import RewardFileError, RewardFunction, reward_verdict
from coba_tasks.engines.verify import (
    FALLBACK_SOURCE,
    Gsm8kAnswer,
    TruthCheck,
    Verdict,
    VerdictKind,
    Verifier,
    gsm8k_verifier,
    qualified_name,
    run_verifier,
    score,
    verifier_for,
    verifier_modules,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_WORKERS = 2
DEFAULT_MAX_CHARS = 1_000_000  # longer completions are scored `error` by the pool without parsing
STARTUP_TIMEOUT_S = 120.0  # a fresh worker imports sympy and math-verify before it says "ready"


def _truth_verdict(check: TruthCheck, completion: str, ground_truth: str) -> Verdict:
    """A ground-truth check as a verdict (so the pool runs it like a verifier): correct when usable."""
    try:
        check(ground_truth)
    except ValueError as exc:
        return Verdict.of(VerdictKind.ERROR, detail=str(exc))
    return Verdict.of(VerdictKind.CORRECT)


# --------------------------------------------------------------------------- worker processes


OOM_SCORE_ADJ = "/proc/self/oom_score_adj"  # Linux: how willing the kernel is to kill this process, -1000..1000


def first_to_go_when_memory_runs_out() -> None:
    """Make this process the kernel's first choice when memory runs out, so that a verifier or a reward file
    that eats memory is killed (its item scores ``error``) rather than the trainer. Not Linux: nothing."""
    try:
        with open(OOM_SCORE_ADJ, "w") as f:
            f.write("1000")
    except OSError:
        pass


def _worker_main(
    conn: Connection, warmup: bool, preload: tuple[str, ...], reward: RewardFunction | None = None
) -> None:
    """Worker loop: receive (verifier, completion, ground_truth), send back a Verdict; None stops it. Before it:
    ``("loading", pid)`` when the reward file's import starts (under the per-item limit from then on), then
    ``("ready", pid, why)``, ``why`` the ``RewardFileError`` line when the file could not be loaded, else None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    first_to_go_when_memory_runs_out()
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # reported as an `error` verdict by the first item that needs the module
            logger.warning("verifier worker: cannot import %s", module, exc_info=True)
    load_error = None
    if reward is not None:  # imported before taking items, out of any item's limit but under one of its own
        conn.send(("loading", os.getpid()))
        try:
            reward.load()
        except RewardFileError as exc:  # every item then scores `error` with this message
            load_error = str(exc)
            logger.warning("verifier worker: %s", exc)
    if warmup:  # import sympy and math-verify and fill its caches before taking items
        score("\\boxed{1}", "1", FALLBACK_SOURCE)
    conn.send(("ready", os.getpid(), load_error))
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
        conn.send(run_verifier(verifier, completion, ground_truth))


class _Worker:
    """One worker process, its pipe, and the item it is scoring (index into the batch, deadline)."""

    def __init__(self, ctx: Any, warmup: bool, reward: RewardFunction | None = None) -> None:
        # every registered verifier's module imported before taking items, out of any item's limit
        preload = tuple(sorted(verifier_modules() - {score.__module__}))  # verify: imported with this module
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, warmup, preload, reward), daemon=True, name="coba-verifier"
        )
        self.process.start()
        child_conn.close()  # so that the parent sees EOF when the worker dies
        self.started_at = time.monotonic()
        self.ready = False
        self.loading_until = float("inf")  # when importing the reward file: the end of its time limit
        self.load_error: str | None = None  # why the reward file could not be loaded here, if it could not
        self.item: int | None = None
        self.deadline = float("inf")

    def start_deadline(self, startup_timeout_s: float) -> float:
        """When a worker that is not ready yet has run out of time: its start-up limit, or the reward file's."""
        return min(self.started_at + startup_timeout_s, self.loading_until)

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

    ``timeout_s``: the limit, from the moment a worker takes the item. ``start_method``: "spawn" or
    "forkserver" ("fork" is unsafe next to torch's threads). ``warmup``: workers import math-verify before
    taking items, so import time never counts against an item's limit. ``max_chars``: None for no limit.
    ``reward_function`` scores every item instead of the built-in verifiers. ``gsm8k_answer``: the config's
    ``verify.gsm8k_answer``. Not thread-safe. Workers start on the first batch that needs them.
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
        reward_function: RewardFunction | None = None,
        gsm8k_answer: Gsm8kAnswer = "math",
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
        self.reward_function = reward_function
        gsm8k_verifier(gsm8k_answer)  # ValueError for an unknown mode, before any batch
        self.gsm8k_answer = gsm8k_answer
        self.warmup = warmup and reward_function is None  # a reward file scores every item: no math-verify
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
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def start(self) -> VerifierPool:
        """Start the workers now and wait until each is ready (otherwise the first batch that needs them does)."""
        self._spawn_missing()
        while starting := [w for w in self._workers if not w.ready]:
            self._wait_and_service(starting, [], {})
        return self

    def close(self) -> None:
        """Stop every worker (politely, then by SIGKILL)."""
        for w in self._workers:
            w.stop(graceful=True)
        self._workers = []

    def score(self, items: Sequence[tuple[str, str, str] | tuple[str, str, str, Any]]) -> list[Verdict]:
        """Verdicts of ``(completion, ground_truth, data_source[, extra_info])`` items, in order; ``extra_info``
        (the row's dict) is the reward function's argument (the built-in verifiers do not read it)."""
        entries = []
        rf = self.reward_function
        for i, item in enumerate(items):
            if len(item) not in (3, 4):
                raise ValueError(
                    f"item {i} has {len(item)} fields; expected (completion, ground_truth, data_source) "
                    "or (completion, ground_truth, data_source, extra_info)"
                )
            completion, ground_truth, source = item[:3]
            if rf is None:
                entries.append((verifier_for(source, gsm8k_answer=self.gsm8k_answer), completion, ground_truth))
                continue
            extra_info = item[3] if len(item) == 4 else None
            fn = partial(reward_verdict, rf, str(source), extra_info if isinstance(extra_info, dict) else None)
            entries.append((Verifier(rf.label, fn), completion, ground_truth))
        return self._score_entries(entries)

    def check_truths(self, items: Sequence[tuple[str, str]]) -> list[str | None]:
        """Check ``(ground_truth, data_source)`` items with their verifiers' ``check``, under the same
        wall-clock limit as scoring: None for a usable ground truth, else why not (one line). Sources
        without a verifier are checked by the fallback's (math); verifiers without a check pass all."""
        unique = list(dict.fromkeys((str(gt), str(src)) for gt, src in items))
        entries, index = [], {}
        for gt, src in unique:
            verifier = verifier_for(src, gsm8k_answer=self.gsm8k_answer)
            if verifier.check is None:
                continue
            index[(gt, src)] = len(entries)
            checker = Verifier(
                f"{verifier.name} ground truth", partial(_truth_verdict, verifier.check), verifier.in_process
            )
            entries.append((checker, "", gt))
        verdicts = self._score_entries(entries)
        reasons: dict[tuple[str, str], str] = {}  # none for a usable ground truth
        for (gt, src), k in index.items():
            v = verdicts[k]
            if v.verdict is VerdictKind.TIMEOUT:
                reasons[gt, src] = (
                    f"the {src} verifier could not read the ground truth {gt!r} within {self.timeout_s:g} s"
                )
            elif v.verdict is not VerdictKind.CORRECT:
                reasons[gt, src] = v.detail or f"the {src} verifier cannot read the ground truth {gt!r}"
        return [reasons.get((str(gt), str(src))) for gt, src in items]

    def _score_entries(self, entries: Sequence[tuple[Verifier, str, str]]) -> list[Verdict]:
        results: list[Verdict | None] = [None] * len(entries)
        pending: deque[tuple[int, bytes, str]] = deque()
        for i, (verifier, completion, ground_truth) in enumerate(entries):
            if verifier.in_process:
                results[i] = run_verifier(verifier, completion, ground_truth)
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
                    detail=f"cannot send verifier {qualified_name(verifier.fn)} to a worker ({exc!r}); "
                    "define it at module level in an importable module",
                )
                continue
            pending.append((i, payload, verifier.name))
        if pending:
            try:
                self._run(pending, results)
            except BaseException:
                # Ctrl-C or a failed start-up: busy workers would later answer for items of this batch
                self.close()
                raise
        return results  # type: ignore[return-value]  # every entry has its verdict now

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
            if not pending and all(w.item is None for w in self._workers):
                return
            self._wait_and_service([w for w in self._workers if not w.ready or w.item is not None], results, names)

    def _wait_and_service(self, active: list[_Worker], results: list[Verdict | None], names: dict[int, str]) -> None:
        """Wait until one of ``active`` answers, dies or reaches its deadline, then service every worker."""
        deadlines = [w.deadline if w.ready else w.start_deadline(self.startup_timeout_s) for w in active]
        wait_s = max(0.0, min(deadlines) - time.monotonic())
        wait([w.conn for w in active] + [w.process.sentinel for w in active], timeout=wait_s)
        for slot in range(len(self._workers)):
            self._service(slot, results, names)

    def _spawn_missing(self) -> None:
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self._ctx, self.warmup, self.reward_function))

    def _service(self, slot: int, results: list[Verdict | None], names: dict[int, str]) -> None:
        w = self._workers[slot]
        now = time.monotonic()
        if not w.ready:
            message = None
            while message is None and w.conn.poll():
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    break
                if message[0] == "loading":  # the reward file's import: as long as an item may take
                    w.loading_until, message = now + self.timeout_s, None
            if message is not None:
                w.ready, w.load_error = True, message[2]
            elif w.loading_until < float("inf") and (not w.process.is_alive() or now >= w.loading_until):
                self._reward_file_failed(w)
            elif not w.process.is_alive() or now > w.started_at + self.startup_timeout_s:
                alive = w.process.is_alive()
                self.close()
                raise RuntimeError(
                    f"a verifier worker did not start within {self.startup_timeout_s:g} s"
                    if alive
                    else f"a verifier worker died while starting ({_exit_detail(w.process.exitcode)}); its "
                    "traceback is on stderr. Usual causes: the main script lacks an `if __name__ == '__main__':` "
                    "guard (spawn re-imports it), or `import coba_tasks.engines.verify_pool, math_verify` fails here"
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

    def _reward_file_failed(self, w: _Worker) -> NoReturn:
        """A worker that died, or ran past the per-item limit, while importing the reward file: stop every
        worker and say so in one line (a file whose top-level code cannot run in time cannot score anything)."""
        alive = w.process.is_alive()
        for other in self._workers:  # at once: a worker busy importing would not answer a polite stop
            other.stop(graceful=False)
        self._workers = []
        path = self.reward_function.path if self.reward_function else "?"
        why = (
            f"did not import within {self.timeout_s:g} s (verify.timeout_s): its top-level code runs too long in "
            "a verifier worker; do slow set-up on the first call instead, or raise verify.timeout_s"
            if alive
            else f"stopped the verifier worker that imported it ({_exit_detail(w.process.exitcode)}); fix its "
            "top-level code"
        )
        raise RewardFileError(f"{REWARD_KEY}: {path} {why}")

    def load_errors(self) -> list[str]:
        """Why the reward file could not be loaded, per started worker that could not (one line each)."""
        return [w.load_error for w in self._workers if w.ready and w.load_error]

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop(graceful=False)
        self._workers[slot] = _Worker(self._ctx, self.warmup, self.reward_function)
        self.restarts += 1


def check_reward_function(reward: RewardFunction, timeout_s: float) -> None:
    """Import ``reward``'s file in a verifier worker, never in this process, within ``timeout_s``:
    ``RewardFileError`` (one line) when it does not exist, does not import (in time), or lacks the function."""
    with VerifierPool(workers=1, timeout_s=timeout_s, reward_function=reward) as pool:
        pool.start()
        errors = pool.load_errors()
    if errors:
        raise RewardFileError(errors[0])


def score_batch(
    items: Sequence[tuple[str, str, str]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    workers: int = DEFAULT_WORKERS,
) -> list[Verdict]:
    """Score a batch in a fresh ``VerifierPool``, then stop it (a training loop keeps one pool instead)."""
    with VerifierPool(workers=workers, timeout_s=timeout_s) as pool:
        return pool.score(items)
