"""``coba run``, ``coba resume`` and ``coba rerun``: their parsers and handlers, and the summary a run prints.

    coba run --config configs/tiny-test.yaml --run-dir runs/tiny --steps 2
    coba resume --run-dir runs/tiny
    coba rerun --run-dir runs/tiny --step 1 --stage rewards --yes

Each handler checks what it can before the Prefect training flow (``flows.train``) starts, so that a
refusal is one line, not a failed flow run's log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from coba_tasks.commands.args import add_command, option, positive_int
from coba_tasks.commands.console import VERBOSE_OPTION
from coba_tasks.commands.model_cmd import cmd_bootstrap


def add_train_parsers(subparsers: Any) -> None:
    """Register ``coba run``, ``coba resume`` and ``coba rerun``, in this order; each sets its ``func``."""
    from coba_tasks.pipeline.tables import RERUNNABLE

    add_command(
        subparsers,
        "run",
        help="train a model with CoBA-RL budgets (Prefect flow over Parquet)",
        description="Run the training flow: per step budget allocation, rollout generation (vLLM), verification, "
        "failure-rate update and a GRPO update; every stage's output is a Parquet table in the run "
        "directory. Held-out accuracy is measured before and after (and every run.eval_every steps).",
        examples=[
            "coba run",
            "coba run --steps 5 --set allocation.strategy=uniform --run-dir runs/uniform",
            "coba run --config configs/tiny-test.yaml --run-dir runs/tiny --set optim.lr=3e-5",
        ],
        options=[
            option("--config", default=None, help="YAML config (default configs/demo.yaml)"),
            option("--run-dir", default=None, help="run directory (default runs/<run.name>); must not exist"),
            option("--dataset", default=None, help="training Parquet (veRL or prompt/answer); sets data.train"),
            option("--steps", type=positive_int, default=None, help="training steps; sets run.steps"),
            option("--set", action="append", metavar="KEY=VALUE", help="override a config value, e.g. optim.lr=3e-5"),
            option(
                "--bootstrap-if-missing",
                action="store_true",
                help="build the default model first when model.path is missing",
            ),
            VERBOSE_OPTION,
        ],
        func=cmd_run,
    )

    add_command(
        subparsers,
        "resume",
        help="continue a stopped or failed run from the first stage not done",
        description="Continue the run in --run-dir with its own config (config.yaml): stages already done (in their "
        "step's _manifest.json) are not recomputed, so the finished run equals an uninterrupted one. A run written "
        "by another schema version is refused.",
        examples=["coba resume --run-dir runs/demo", "coba resume --run-dir runs/demo --repair"],
        options=[
            option("--run-dir", required=True, help="the run directory to continue"),
            option(
                "--repair",
                action="store_true",
                help="recompute from the first table that is missing, truncated or altered (checked against the "
                "manifests)",
            ),
            option(
                "--allow-changed-inputs",
                action="store_true",
                help="continue although data.test, model.path or the reward file changed since the run started "
                "(their sha256 is in run.json; refused otherwise)",
            ),
            option(
                "--trust-remote-code",
                action="store_true",
                help="allow the model's own code when the run's config sets model.trust_remote_code (refused "
                "otherwise)",
            ),
            VERBOSE_OPTION,
        ],
        func=cmd_resume,
    )

    add_command(
        subparsers,
        "rerun",
        help="recompute one stage of one step (and everything after it)",
        description="Recompute the stage --stage of step --step. Everything computed after it is invalid too: the "
        "command first lists those outputs, removes them only with --yes, then resumes the run, which recomputes "
        "them. The budget of step N is the table steps/N/budget.parquet (its first stage, from the tables of step "
        "N - 1); eval invalidates only itself.",
        examples=[
            "coba rerun --run-dir runs/demo --step 5 --stage rewards",
            "coba rerun --run-dir runs/demo --step 5 --stage rewards --yes",
            "coba rerun --run-dir runs/demo --step 12 --stage eval --yes --no-resume",
        ],
        options=[
            option("--run-dir", required=True, help="the run directory"),
            option("--step", type=int, required=True, help="the step (0-based, as in steps/NNNNNN/)"),
            option("--stage", required=True, choices=RERUNNABLE, help="the stage to recompute"),
            option("--yes", action="store_true", help="remove the invalidated outputs (default: only list them)"),
            option("--no-resume", action="store_true", help="with --yes: remove, but do not resume the run"),
            VERBOSE_OPTION,  # each of the three starts the engines: last, after the command's own arguments
        ],
        func=cmd_rerun,
    )


def cmd_run(args: argparse.Namespace) -> int:
    """Run ``coba run``: load and check the config and the data, then the training flow in a new run directory."""
    from coba_tasks.pipeline.config import check_installed, check_paths, load_config

    given = {"run.steps": args.steps, "data.train": args.dataset}
    overrides = [*(args.set or []), *(f"{key}={value}" for key, value in given.items() if value is not None)]
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / cfg.run.name
    blocked = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)  # the nearest that exists
    if blocked is not None and not blocked.is_dir():
        raise ValueError(
            f"--run-dir {run_dir}: {blocked} is a file, not a directory; give a new or empty directory (e.g. "
            f"runs/{cfg.run.name})"
        )
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"run directory {run_dir} already exists; pick another --run-dir (or resume it)")
    if args.bootstrap_if_missing and not (Path(cfg.model.path) / "config.json").is_file():
        _check_default_tiny_model(cfg.model.path)  # a mistyped model.path is never built under that name
        print(f"model {cfg.model.path} is missing: bootstrapping it first")
        data = {"train": "data/arith_train.parquet", "test": "data/arith_test.parquet"}
        rc = cmd_bootstrap(argparse.Namespace(out=cfg.model.path, **data, seed=0, steps=None, force=False))
        if rc:
            return rc
    elif args.bootstrap_if_missing:
        from coba_tasks.engines.bootstrap import stale_bootstrap_note

        note = stale_bootstrap_note(Path(cfg.model.path))
        if note:
            print(note)
    check_paths(cfg)
    check_installed(cfg.run.trackers)  # a tracker's library missing: one line naming its pip extra, before Prefect
    allow_user_code(cfg)
    from coba_tasks.pipeline.data import load_run_datasets

    load_run_datasets(cfg)  # a bad dataset or over-long prompt fails here, before anything is written
    from coba_tasks.commands.prefect_env import configure_prefect, start_local_server

    configure_prefect()
    start_local_server()  # a server that cannot start: one line; a slow first start is waited for
    from flows.train import train_flow

    summary = train_flow(config=cfg, run_dir=str(run_dir))  # the config built and checked here, typed
    _print_summary(summary)
    return 0


def allow_user_code(cfg: Any) -> None:
    """Let the model's own code (``model.trust_remote_code``) and the reward file (``verify.reward_function``)
    of ``cfg`` run: the user's own command asks for them, on this machine (processes it starts inherit it)."""
    if cfg.model.trust_remote_code:
        from coba_tasks.pipeline.run import allow_remote_code

        allow_remote_code()
    if cfg.verify.reward_function.strip():
        from coba_tasks.pipeline.deployment import allow_reward_files

        allow_reward_files()


def _check_default_tiny_model(path: str) -> None:
    """Refuse to bootstrap anywhere but the default tiny model's path: a missing ``model.path`` elsewhere is
    a typo or a model not converted yet, and a fresh tiny model under its name would train silently."""
    from coba_tasks.pipeline.config_sections import ModelConfig

    default = ModelConfig.model_fields["path"].default
    if Path(path).resolve() != Path(default).resolve():
        raise ValueError(
            f"model.path {path} is missing; --bootstrap-if-missing builds only the default tiny model ({default}): "
            "check the path (make smollm2 converts SmolLM2), or build a tiny model there with coba bootstrap --out"
        )


def cmd_resume(args: argparse.Namespace) -> int:
    """Run ``coba resume``: check the run (lock, config, tables, inputs, checkpoint), then continue its flow."""
    from coba_tasks.pipeline.policy import policy_class
    from coba_tasks.pipeline.progress import first_step_not_done, run_length
    from coba_tasks.pipeline.run import check_inputs, read_run_config
    from coba_tasks.pipeline.runlock import RunLock
    from coba_tasks.pipeline.store import RunStore
    from coba_tasks.pipeline.tables import step_label

    store = RunStore.open(args.run_dir)  # refuses a missing run or another schema version
    RunLock(store.root).check_free()  # a run still going there: refuse before starting anything
    cfg = read_run_config(store)  # a damaged config.yaml: one line naming it
    from coba_tasks.pipeline.config import check_installed

    check_installed(cfg.run.trackers)
    if cfg.model.trust_remote_code and not args.trust_remote_code:
        raise ValueError(
            f"{store.root / 'config.yaml'} sets model.trust_remote_code: the model's own code would run; "
            "resume it with --trust-remote-code if you trust that model"
        )
    allow_user_code(cfg)  # the reward file's hash is checked below
    from coba_tasks.pipeline.evaluation import run_complete
    from coba_tasks.pipeline.rerun import apply_rerun, damaged_tables, plan_repair, resume_weights

    damaged = damaged_tables(store)  # every done table is checked against its manifest (size, sha256)
    if damaged and not args.repair:
        step, name, reason = damaged[0]
        raise ValueError(f"{len(damaged)} damaged table(s), the first at step {step} ({name}): {reason}")
    if damaged:
        plan = plan_repair(store)
        print(f"repairing: {len(damaged)} damaged table(s), the first at step {damaged[0][0]} ({damaged[0][1]})")
        print(plan.describe(store.root))
        for line in resume_weights(store, plan):
            print(line)
        with RunLock(store.root):
            apply_rerun(store, plan)
    length = run_length(store, cfg)  # run.steps, or fewer under run.rollout_budget
    first = first_step_not_done(store, length)
    summary_file = store.root / "summary.json"
    if run_complete(store, cfg):  # an evaluation left missing (weights that could not be rebuilt) is resumed
        print(f"{store.root}: all {length} steps and their evaluations are done; nothing to resume")
        _print_summary(json.loads(summary_file.read_text()))
        return 0
    # what the flow checks too, here first so that a refusal is one line, not a failed flow run's log
    changed = args.allow_changed_inputs
    check_inputs(store, cfg, changed, warn=lambda line: print(f"warning: {line}", file=sys.stderr))
    policy_class(cfg).check_continues(
        store, first
    )  # FSDP: the checkpoint of its step (the file, the rerun that mends it)
    print(f"resuming {store.root} at {step_label(first, cfg.run.steps)}; stages already done are not recomputed")
    from coba_tasks.commands.prefect_env import configure_prefect, start_local_server

    configure_prefect()
    start_local_server()  # a server that cannot start: one line; a slow first start is waited for
    from flows.train import train_flow

    _print_summary(train_flow(run_dir=str(store.root), resume=True, allow_changed_inputs=changed))
    return 0


def cmd_rerun(args: argparse.Namespace) -> int:
    """Run ``coba rerun``: list what the stage invalidates; with --yes remove it and (unless --no-resume) resume."""
    from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun, resume_weights
    from coba_tasks.pipeline.runlock import RunLock
    from coba_tasks.pipeline.store import RunStore

    store = RunStore.open(args.run_dir)
    RunLock(store.root).check_free()
    plan = plan_rerun(store, args.step, args.stage)
    print(plan.describe(store.root))
    for line in resume_weights(store, plan):  # which checkpoint, how many updates replayed: before anything goes
        print(line)
    if not args.yes:
        print("nothing removed: pass --yes to remove these outputs and recompute them")
        return 0
    with RunLock(store.root):
        apply_rerun(store, plan)
    print(f"removed {len(plan.tables)} table(s) and {len(plan.checkpoints)} checkpoint(s)")
    if args.no_resume:
        print(f"continue with: coba resume --run-dir {args.run_dir}")
        return 0
    return cmd_resume(
        argparse.Namespace(run_dir=args.run_dir, repair=False, allow_changed_inputs=False, trust_remote_code=False)
    )


def _print_summary(s: dict) -> None:
    """The end of ``coba run`` and ``coba resume``: the run's figures as ``coba inspect`` shows them, then the
    timings this process measured (``s`` is the flow's summary.json)."""
    from coba_tasks.readers.figures import run_summary
    from coba_tasks.readers.views import format_summary

    print()
    print(format_summary(run_summary(s["run_dir"])))
    print("time per stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in s["stage_seconds"].items()))
    step_s, over_s = s.get("step_seconds_mean", float("nan")), s.get("prefect_overhead_seconds_per_step", float("nan"))
    print(f"per step: {step_s:.2f} s, of which Prefect orchestration {over_s:.2f} s ({over_s / step_s:.0%})")
    report = Path(s["run_dir"]) / "report"
    if (report / "index.html").is_file():
        pictures = ", ".join(sorted(p.name for p in report.glob("*.png")))
        print(f"report: {report / 'index.html'} ({pictures})")
