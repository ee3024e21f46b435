"""``coba eval``: held-out figures of a model, a run's checkpoint or a LoRA checkpoint on a dataset.

It runs the ``coba-eval`` flow (``flows.eval``), the evaluation a training run makes (one implementation:
``coba_tasks.pipeline.evaluation.evaluate``): avg@k, greedy, pass@k (unbiased, k = 1 .. samples), by
difficulty and by data source. The settings are a run config's evaluation settings (``--config``; for a
run's checkpoint its run's config.yaml, else the defaults) with the options given here on top.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from coba_tasks.commands.args import Command, non_negative_float, option, positive_int
from coba_tasks.commands.console import VERBOSE_OPTION


def _levels(value: str) -> tuple[int, ...]:
    """``--difficulties``: ``0,1`` or ``all`` (every level).

    >>> _levels("0,2"), _levels("all")
    ((0, 2), ())
    """
    if value.strip() == "all":
        return ()
    try:
        return tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected levels like 0,1 or all, got {value!r}") from None


def run_config_of(model: str) -> Path | None:
    """The config.yaml of the run a checkpoint (``<run>/checkpoints/NNNNNN``) belongs to, if there is one.

    >>> run_config_of("models/arith-tiny") is None
    True
    """
    path = Path(model)
    config = path.parent.parent / "config.yaml"
    return config if path.parent.name == "checkpoints" and config.is_file() else None


def eval_settings_for(args: argparse.Namespace) -> tuple[Any, str]:
    """The evaluation settings ``args`` ask for, and where their defaults came from."""
    from coba_tasks.pipeline.config import load_config
    from coba_tasks.pipeline.evaluation import EvalSettings, eval_settings

    config = args.config or run_config_of(args.model)
    base = EvalSettings.from_config(load_config(config)) if config else EvalSettings()
    changes = {
        "test_path": args.dataset,
        "samples": args.samples,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "eval_prompts": args.prompts,
        "difficulties": args.difficulties,
        "seed": args.seed,
        "backend": args.backend,
        "greedy": False if args.no_greedy else None,
    }
    if args.temperature == 0 and args.samples is None:  # greedy decoding: one completion says it all
        changes["samples"] = 1
    source = f"the config {config}" if config else "the defaults"
    if args.samples is not None and args.samples > 1 and args.temperature is None and base.temperature == 0:
        changes["temperature"] = 1.0  # several samples of a greedy default: sampled at 1.0, and said so
        source += f"; temperature 1.0, since --samples {args.samples} asks for samples and no --temperature was given"
    settings = eval_settings(base, **{k: v for k, v in changes.items() if v is not None})
    return settings, source


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate; print the figures (or one JSON object with ``--json``)."""
    from coba_tasks.pipeline.evaluation import check_eval_inputs

    if bool(args.dataset) == bool(args.census):
        raise ValueError("give --dataset (held-out prompts) or --census RUN_DIR (a run's training pool), one of them")
    if args.census:
        return cmd_census(args)

    settings, source = eval_settings_for(args)
    check_eval_inputs(args.model, settings, args.out, args.overwrite)  # before Prefect and the engine start
    from coba_tasks.commands.prefect_env import configure_prefect, start_local_server

    configure_prefect()
    start_local_server()
    from flows.eval import eval_flow

    figures = eval_flow(args.model, settings, args.out, args.overwrite, progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps({**figures, "settings": settings.model_dump(), "settings_from": source}, indent=2))
        return 0
    s = settings
    print(
        f"{args.model} on {s.test_path}: {figures['prompts']} prompts x {s.samples} samples "
        f"(temperature {s.temperature}, top-p {s.top_p}, at most {s.max_tokens} tokens; settings from {source})"
    )
    for label, text in eval_rows(figures, s.samples):
        print(f"  {label:<10} {text}")
    return 0


CENSUS_SAMPLES = 64  # completions per prompt of a census unless --samples says otherwise


def cmd_census(args: argparse.Namespace) -> int:
    """``coba eval --census RUN_DIR``: the run's training pool, each prompt ``--samples`` times at its training
    sampling, scored as the run scores (``evaluation.pool_census``); how many prompts each count of solved
    completions has (by level where the pool has levels), the table to ``--out``."""
    from coba_tasks.pipeline.evaluation import check_eval_output, eval_settings, pool_census, write_eval_table
    from coba_tasks.pipeline.run import read_run_config
    from coba_tasks.pipeline.store import RunStore

    store = RunStore.open(args.census)
    cfg = read_run_config(store)
    if cfg.verify.reward_function.strip():  # the run's own scoring, asked for by the user's own command
        from coba_tasks.pipeline.deployment import allow_reward_files

        allow_reward_files()
    samples = args.samples or CENSUS_SAMPLES
    if args.out:  # never an input of the census: the model, its base, the run's tables
        test = str(store.root / "prompts.parquet")
        check_eval_output(args.out, args.model, eval_settings(test_path=test), args.overwrite)
    table = pool_census(store, cfg, args.model, samples, args.prompts or 0, progress=sys.stderr.isatty())
    written = write_eval_table(table, args.out, args.overwrite) if args.out else None
    counts = census_counts(table, samples)
    if args.json:
        print(json.dumps({"model": args.model, "run": str(store.root), "samples": samples, **counts, "out": written}))
        return 0
    r = cfg.rollout
    print(
        f"{args.model} on {store.root}'s training pool: {len(table)} prompts x {samples} samples (temperature "
        f"{r.temperature}, top-p {r.top_p}, at most {r.max_tokens} tokens: the run's training sampling)"
    )
    for label, text in census_rows(counts, samples):
        print(f"  {label:<14} {text}")
    if written:
        print(f"  {'table':<14} {written} (per prompt: solved of samples)")
    return 0


def census_counts(table: Any, samples: int) -> dict[str, Any]:
    """Prompts by the completions they solved: ``never`` (0), ``sometimes`` (1 .. samples - 1, each count in
    ``by_solved``), ``always`` (all); the same by difficulty level where there are levels.

    >>> import pandas as pd
    >>> t = pd.DataFrame({"solved": [0, 0, 1, 3, 4], "difficulty": [1, 1, 1, 0, 0]})
    >>> census_counts(t, 4)["by_level"]
    {'0': {'never': 0, 'sometimes': 1, 'always': 1}, '1': {'never': 2, 'sometimes': 1, 'always': 0}}
    """

    def classes(solved: Any) -> dict[str, int]:
        return {
            "never": int((solved == 0).sum()),
            "sometimes": int(((solved > 0) & (solved < samples)).sum()),
            "always": int((solved == samples).sum()),
        }

    solved = table["solved"]
    out: dict[str, Any] = classes(solved)
    out["by_solved"] = {str(k): int(v) for k, v in solved.value_counts().sort_index().items()}
    levels = table.get("difficulty")
    if levels is not None and (levels >= 0).any():
        out["by_level"] = {str(lv): classes(part["solved"]) for lv, part in table.groupby("difficulty")}
    return out


def census_rows(counts: dict[str, Any], samples: int) -> list[tuple[str, str]]:
    """(label, text) rows of a census."""
    total = counts["never"] + counts["sometimes"] + counts["always"]
    share = lambda n: f"{n} ({n / total:.0%})" if total else str(n)  # noqa: E731
    rows = [
        ("never solved", f"{share(counts['never'])}: 0 of {samples}"),
        ("sometimes", f"{share(counts['sometimes'])}: 1 to {samples - 1} of {samples}, the prompts more samples crack"),
        ("always solved", share(counts["always"])),
        ("solved: prompts", "  ".join(f"{k}: {v}" for k, v in counts["by_solved"].items())),
    ]
    for level, c in (counts.get("by_level") or {}).items():
        rows.append((f"level {level}", f"never {c['never']}, sometimes {c['sometimes']}, always {c['always']}"))
    return rows


def eval_rows(figures: dict[str, Any], samples: int) -> list[tuple[str, str]]:
    """(label, text) rows of ``coba eval``'s figures.

    >>> f = {"accuracy": 0.5, "greedy": None, "pass_at_k": {"1": 0.5, "2": 0.75}, "answered": 1.0,
    ...      "boxed": 0.0, "by_difficulty": {"0": 0.5}, "by_data_source": {}, "out_path": None}
    >>> for row in eval_rows(f, 2): print(row)
    ('avg@2', '0.500')
    ('pass@k', '@1 0.500  @2 0.750')
    ('answered', '1.000 (share of completions with an answer)')
    ('by level', 'L0 0.500')
    """
    rows = [(f"avg@{samples}", f"{figures['accuracy']:.3f}")]
    if figures.get("greedy") is not None:
        rows.append(("greedy", f"{figures['greedy']:.3f}"))
    if len(figures["pass_at_k"]) > 1:
        rows.append(("pass@k", "  ".join(f"@{k} {v:.3f}" for k, v in figures["pass_at_k"].items())))
    rows.append(("answered", f"{figures['answered']:.3f} (share of completions with an answer)"))
    if figures.get("boxed"):
        rows.append(("boxed", f"{figures['boxed']:.3f} (share of completions with \\boxed{{}})"))
    if figures["by_difficulty"]:
        rows.append(("by level", "  ".join(f"L{k} {v:.3f}" for k, v in figures["by_difficulty"].items())))
    for src, f in figures["by_data_source"].items():
        k = max(f["pass_at_k"], key=int, default="1")
        passes = f"  pass@{k} {f['pass_at_k'][k]:.3f}" if k != "1" else ""
        rows.append((f"{src}", f"avg {f['accuracy']:.3f}{passes}  ({f['prompts']} prompts)"))
    if figures.get("out_path"):
        rows.append(("table", str(figures["out_path"])))
    return rows


COMMAND = Command(
    "eval",
    help="held-out avg@k, greedy and pass@k of a model or a checkpoint on a dataset",
    description="Evaluate a model directory, a run's checkpoint or a LoRA checkpoint (merged on the fly after "
    "its base model is checked) on a Parquet dataset (veRL or prompt/answer), as a training run evaluates: "
    "avg@k over --samples completions, greedy accuracy, pass@k (unbiased, k = 1 .. samples), by difficulty "
    "and by data source. Settings come from --config (for a run's checkpoint, its run's config.yaml; else "
    "the defaults) with these options on top. Runs the coba-eval Prefect flow. --census RUN_DIR instead "
    "samples that run's training pool at its training sampling, scored as the run scores: which prompts "
    "more samples would crack.",
    examples=[
        "coba eval --model runs/demo/checkpoints/000010 --dataset data/arith_chat_test.parquet",
        "coba eval --model runs/demo/checkpoints/000010 --dataset data/arith_chat_test.parquet --samples 16 --json",
        "coba eval --model models/smollm2-135m-instruct --dataset data/arith_chat_test.parquet "
        "--config configs/demo.yaml --prompts 0",
        "coba eval --model runs/demo/checkpoints/000010 --dataset data/arith_chat_test.parquet "
        "--out evals/demo-step10.parquet",
        "coba eval --model runs/demo/checkpoints/000004 --census runs/demo --samples 32 --out evals/census-4.parquet",
    ],
    options=[
        option("--model", required=True, help="a model directory, a run's checkpoint or a LoRA checkpoint"),
        option("--dataset", default=None, help="held-out prompts: a Parquet file (veRL or prompt/answer)"),
        option(
            "--census",
            metavar="RUN_DIR",
            default=None,
            help="instead of --dataset: that run's training pool at its training sampling and scoring, "
            f"--samples (default {CENSUS_SAMPLES}) a prompt: how many completions each prompt solves",
        ),
        option("--config", default=None, help="YAML run config whose evaluation settings to use"),
        option("--samples", type=positive_int, default=None, help="completions per prompt (avg@k, pass@k)"),
        option("--temperature", type=non_negative_float, default=None, help="sampling temperature; 0 = greedy"),
        option("--top-p", type=float, default=None, help="nucleus of the sampled completions; 1.0 = none"),
        option("--max-tokens", type=positive_int, default=None, help="most tokens a completion has"),
        option("--prompts", type=int, default=None, help="a seeded sample of this many prompts; 0 = all"),
        option("--seed", type=int, default=None, help="seed of the prompt sample and of sampling"),
        option(
            "--difficulties",
            type=_levels,
            default=None,
            metavar="0,1|all",
            help="keep the prompts of these levels (default: the config's data.difficulties, as its run did)",
        ),
        option("--backend", default=None, help="rollout engine: vllm or transformers (default: the config's)"),
        option("--no-greedy", action="store_true", help="skip the greedy decoding beside the sampled one"),
        option("--out", default=None, help="write the per-prompt table here (Parquet; never over an existing file)"),
        option("--overwrite", action="store_true", help="let --out replace an existing file (never an input)"),
        option("--json", action="store_true", help="print the figures as one JSON object"),
        VERBOSE_OPTION,
    ],
    func=cmd_eval,
)
