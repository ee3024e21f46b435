"""``coba bench stages``: where a training step's time goes, printed as ratios measured in one run.

Everything runs in one process, one after the other, on the same machine state:

1. **Rollout stage vs bare vLLM.** For the prompts, budgets and seeds of one step, the rollout stage
   (``stages.rollout_table``: requests, ``VLLMBackend.generate``, the DataFrame) against a bare
   ``llm.generate(prompts, [SamplingParams(n=b_i, seed=s_i, ...)])`` on the same ``vllm.LLM``
   object (prompts and parameters built outside the timed region), alternated and compared by
   medians. The Parquet write of the rollouts table is a figure of its own.
2. **A step through Prefect.** The run's steps go through the training flow (``coba-train``, the
   flow ``coba run`` starts: the stage task runs, the progress line, the artifacts); per stage the mean
   seconds of its body (timing.json) and Prefect's own time per step as the flow measures it in every
   run (the step's wall time minus the time inside the stage bodies, summary.json's
   ``prefect_overhead_seconds_per_step``) as a share of the step. The stages below are then measured
   on the finished run, its last step's tables and its final weights.
3. **Parquet per step.** ``RunStore.write_table`` and ``read_table`` (sha256 verified) of each of
   the step's tables, in a scratch run directory.
4. **Verification.** ``VerifierPool.score`` items per second on the step's rollouts.
5. **GRPO update.** ``PolicyTrainer.update`` completion tokens per second on the step's rollouts;
   also the checkpoint save and the vLLM weight reload that end the update stage.

Times are medians over repeats (steps: means over the steps); compare the ratios, not the
absolute times (the machines are shared and noisy). Nothing here asserts a time: the goals are
printed with whether this run met them.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from coba_tasks.bench.timing import available_cpus, timed
from coba_tasks.bench.timing import median_time as bench_median_time
from coba_tasks.pipeline import update_batch
from coba_tasks.pipeline.store import STAGES, Table

GOALS = {"rollout_stage_over_bare": 1.10, "orchestration_share": 0.10}
Train = Callable[[Any, str], dict]  # (config, run directory) -> the summary of the training flow (coba-train)
EVAL_PROMPTS = 16  # held-out prompts per evaluation in the benchmark's runs (unless --set data.eval_prompts=...)
# a step's tables (the pilot's only under allocation.estimator = pilot, which the benchmark does not time)
# the tables of a step sampled once (not a pilot's, nor a round's: the demo's steps have neither)
STEP_TABLES = tuple(t.value for t in (*STAGES, Table.HISTORY))


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    return bench_median_time(fn, repeats, warmup=False)  # stateful calls (the update): no untimed extra call


def _bench_config(config_path: str | None, overrides: Sequence[str], steps: int):
    """The config of the run: the file with the overrides, ``steps`` steps, no evaluation in between."""
    from coba_tasks.pipeline.config import check_paths, load_config

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    # no evaluation between steps (it is not part of a step); a small held-out set for the one before and after
    forced = [f"run.steps={steps}", "run.eval_every=0"]
    cfg = load_config(config_path, [*overrides, *forced])
    if not any(o.strip().startswith("data.eval_prompts=") for o in overrides) and (
        cfg.data.eval_prompts == 0 or cfg.data.eval_prompts > EVAL_PROMPTS
    ):
        cfg = load_config(config_path, [*overrides, *forced, f"data.eval_prompts={EVAL_PROMPTS}"])
    if cfg.rollout.backend != "vllm":
        raise ValueError(
            f"bench stages compares the rollout stage with bare vLLM: needs rollout.backend=vllm, got "
            f"{cfg.rollout.backend!r}"
        )
    if cfg.optim.fsdp_processes != 1:
        raise ValueError(
            "bench stages times the single-process GRPO update: needs optim.fsdp_processes=1, got "
            f"{cfg.optim.fsdp_processes}"
        )
    check_paths(cfg)
    return cfg


def bench_stages(
    train: Train,
    config_path: str | None = "configs/demo-tiny.yaml",
    overrides: Sequence[str] = (),
    steps: int = 3,
    progress: Callable[[str], None] = print,
    repeats: int = 5,
    work_dir: str | os.PathLike[str] | None = None,
) -> dict:
    """Measure where a training step's time goes (see the module docstring); returns the figures.

    ``train(config, run_dir)`` runs the training flow on a new run directory and returns its summary
    (``coba bench stages`` passes ``flows.train.train_flow``); Prefect must be configured
    (``configure_prefect()``, or a test harness) before the call. ``work_dir`` keeps the run directory
    (``run/``) and the scratch one; by default they live in a temporary directory removed at the end.
    Times are seconds.
    """
    cfg = _bench_config(config_path, list(overrides), steps)
    kept = contextlib.nullcontext(work_dir)
    with kept if work_dir is not None else tempfile.TemporaryDirectory(prefix="coba-bench-stages-") as work:
        return _bench(train, cfg, config_path, Path(work), steps, repeats, progress)


def _bench(train: Train, cfg: Any, config_path: str | None, work: Path, steps: int, repeats: int, progress) -> dict:
    import torch

    from coba_tasks.pipeline import run
    from coba_tasks.pipeline import stages as stage_step

    work.mkdir(parents=True, exist_ok=True)
    run_dir, scratch_dir = (work / n for n in ("run", "scratch"))
    for d in (run_dir, scratch_dir):
        if d.exists() and any(d.iterdir()):
            raise ValueError(f"{d} is not empty; give bench stages an empty work directory")
    machine = {
        "python": platform.python_version(),
        "processor": platform.machine(),
        "cpus": available_cpus(),
        "torch_threads_at_start": torch.get_num_threads(),
        "cuda": bool(torch.cuda.is_available()),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }

    # -- 2. the steps through the training flow, as coba run runs them --------------------------------
    progress(f"{steps} steps through the training flow (coba-train)")
    summary = train(cfg, str(run_dir))
    res = run.open_run(run_dir.resolve(), cfg, continuing=True)
    try:
        progress("start the engine, the verifier pool and the trainer on the run's final weights")
        res.policy.start()
        machine["torch_threads"] = torch.get_num_threads()  # what the stages run with
        store = res.store
        timings = [store.read_step_json(t, "timing") for t in range(steps)]
        step = {
            "step_s": float(summary["step_seconds_mean"]),
            "outside_stages_s": float(summary["prefect_overhead_seconds_per_step"]),
            "stage_s": {s.value: float(sum(float(timing[s]) for timing in timings) / steps) for s in STAGES},
        }
        t = steps - 1  # the step whose inputs and outputs the stage benchmarks use
        budget, rollouts, rewards = (store.read_table(t, n) for n in (Table.BUDGET, Table.ROLLOUTS, Table.REWARDS))
        rollout = _bench_rollout(res, cfg, budget, t, repeats, progress, stage_step.sampling(cfg))
        verify = _bench_verify(res, rollouts, rewards, repeats, progress)
        parquet = _bench_parquet(store, scratch_dir, cfg, t, repeats, progress)
        update = _bench_update(res, rollouts, rewards, scratch_dir, repeats, progress)
        rounds = _bench_rounds(res, cfg, budget, t, scratch_dir, repeats, progress)
    finally:
        run.close_run(res)

    machine["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    rollout["write_s"] = parquet["tables"]["rollouts"]["write_s"]
    ratios = {
        "rollout_stage_over_bare": rollout["paired_ratio"],
        "rollout_stage_over_bare_same_requests": rollout["paired_ratio_same_requests"],
        "rollout_stage_and_write_over_bare": (rollout["stage_s"] + rollout["write_s"]) / rollout["bare_s"],
        "orchestration_share": step["outside_stages_s"] / step["step_s"],
    }
    goals = {
        name: {"value": ratios[name], "goal": limit, "met": bool(ratios[name] <= limit)}
        for name, limit in GOALS.items()
    }
    return {
        "benchmark": "stages",
        "config": str(config_path) if config_path is not None else "configs/demo-tiny.yaml",
        "steps": steps,
        "repeats": repeats,
        "measured_step": t,
        "machine": machine,
        "shape": {
            "prompts_per_step": cfg.data.prompts_per_step,
            "group_size": cfg.allocation.group_size,
            "rollouts": len(rollouts),
            "completion_tokens": int(rollouts["n_tokens"].sum()),
            "max_tokens": cfg.rollout.max_tokens,
            "model": cfg.model.path,
        },
        "rollout": rollout,
        "step": step,
        "parquet": parquet,
        "verify": verify,
        "update": update,
        "rounds": rounds,
        "ratios": ratios,
        "goals": goals,
    }


def _bench_rollout(res: Any, cfg: Any, budget: Any, step: int, repeats: int, progress, sampling) -> dict:
    """stages.rollout_table vs a bare llm.generate with the same prompts, budgets and seeds, alternated; and vs
    the same bare call asking for what the stage asks (``logprobs=0``: the sampled tokens' log-probabilities,
    which the update's sampler/trainer gap reads): what the stage adds to the engine's own work."""
    from vllm import SamplingParams

    from coba_tasks.engines.rollout import rollout_seed
    from coba_tasks.pipeline import stages

    llm = res.engine._llm
    ids = res.prompts.set_index("prompt_id")["prompt_token_ids"]
    prompts, params = [], []
    for pid, b in zip(budget["prompt_id"], budget["budget"], strict=True):
        tokens = {"prompt_token_ids": list(ids[pid])}  # the same token prompts; bare vLLM asks for no logprobs
        if sampling.temperature == 0.0:  # as the backend does: greedy takes n = 1, the prompt repeated
            prompts += [tokens] * int(b)
            params += [SamplingParams(n=1, temperature=0.0, max_tokens=sampling.max_tokens)] * int(b)
        else:
            prompts.append(tokens)
            params.append(
                SamplingParams(
                    n=int(b),
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    max_tokens=sampling.max_tokens,
                    seed=rollout_seed(cfg.run.seed, step, pid),
                )
            )

    with_logprobs = [p.clone() for p in params]
    for p in with_logprobs:  # as the backend asks: the sampled token's log-probability, flat lists
        p.logprobs, p.flat_logprobs = 0, True
    calls = {
        "stage": lambda: stages.rollout_table(budget, res.prompts, res.engine, sampling, cfg.run.seed, step),
        "bare": lambda: llm.generate(prompts, params, use_tqdm=False),
        "bare_logprobs": lambda: llm.generate(prompts, with_logprobs, use_tqdm=False),
    }
    progress(f"rollout: stage vs bare vLLM, {repeats} alternating repeats")
    last = {name: call() for name, call in calls.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats):  # alternate the order so that a drift in the machine's load hits each alike
        for name in tuple(calls) if i % 2 == 0 else tuple(reversed(calls)):
            last[name], seconds = timed(calls[name])
            times[name].append(seconds)
    table = last["stage"]
    bare_ids = [list(c.token_ids) for out in last["bare"] for c in out.outputs]
    tokens = int(table["n_tokens"].sum())
    bare_s = statistics.median(times["bare"])
    return {
        "prompts": len(budget),
        "completions": len(table),
        "tokens": tokens,
        "stage_s": statistics.median(times["stage"]),
        "bare_s": bare_s,
        # each repeat's two calls ran side by side: the median of their ratios is steadier than the ratio of the
        # medians when the machine's load moves between repeats (a shared machine's does)
        "paired_ratio": statistics.median(a / b for a, b in zip(times["stage"], times["bare"], strict=True)),
        "bare_logprobs_s": statistics.median(times["bare_logprobs"]),
        "paired_ratio_same_requests": statistics.median(
            a / b for a, b in zip(times["stage"], times["bare_logprobs"], strict=True)
        ),
        "stage_repeats_s": times["stage"],
        "bare_repeats_s": times["bare"],
        "bare_logprobs_repeats_s": times["bare_logprobs"],
        "bare_tokens_per_s": tokens / bare_s,
        "same_completions": [list(x) for x in table["token_ids"]] == bare_ids,
    }


ROUND_SPLITS = (1, 2, 4)  # the step's rollouts sampled in this many rounds (``_bench_rounds``)


def _bench_rounds(res: Any, cfg: Any, budget: Any, step: int, scratch: Path, repeats: int, progress) -> dict:
    """What each extra round of a step costs: the step's budget sampled in 1, 2 and 4 rounds (its prompts cut
    into that many parts, each round as the round stages run one: the rollouts with the round's seeds, scored,
    every round so far written as a table), alternated; per split the median seconds and the seconds per round
    beyond the first against one round."""
    import pandas as pd

    from coba_tasks.pipeline import stages
    from coba_tasks.pipeline.config import config_hash, config_to_dict
    from coba_tasks.pipeline.rounds import ROUND
    from coba_tasks.pipeline.store import RunStore

    out = RunStore(scratch / "rounds")
    out.create(config_to_dict(cfg), config_hash(cfg), {})
    sampling = stages.sampling(cfg)

    def in_rounds(k: int) -> None:
        parts = [budget.iloc[i::k].reset_index(drop=True) for i in range(k)]
        rows, scored = [], []
        for r, part in enumerate(parts):
            fresh = stages.rollout_table(part, res.prompts, res.engine, sampling, cfg.run.seed, step, wave=r)
            rows.append(fresh.assign(**{ROUND: r}))
            scored.append(stages.reward_table(fresh, res.prompts, res.pool).assign(**{ROUND: r}))
            out.write_table(k, Table.ROUND, pd.concat(rows, ignore_index=True))
            out.write_table(k, Table.ROUND_REWARDS, pd.concat(scored, ignore_index=True))

    splits = ", ".join(map(str, ROUND_SPLITS))
    progress(f"rounds: the step's rollouts in {splits} rounds, {repeats} alternating repeats")
    for k in ROUND_SPLITS:
        in_rounds(k)  # warm-up
    times: dict[int, list[float]] = {k: [] for k in ROUND_SPLITS}
    for i in range(repeats):
        for k in ROUND_SPLITS if i % 2 == 0 else tuple(reversed(ROUND_SPLITS)):
            _, seconds = timed(in_rounds, k)
            times[k].append(seconds)
    one = statistics.median(times[1])
    return {
        str(k): {
            "seconds": statistics.median(times[k]),
            "per_extra_round_s": (statistics.median(times[k]) - one) / (k - 1) if k > 1 else 0.0,
        }
        for k in ROUND_SPLITS
    }


def _bench_verify(res: Any, rollouts: Any, rewards: Any, repeats: int, progress) -> dict:
    from coba_tasks.engines.verify import count_verdicts

    meta = res.prompts.set_index("prompt_id").loc[rollouts["prompt_id"]]
    items = list(zip(rollouts["completion"], meta["ground_truth"], meta["data_source"], strict=True))
    progress(f"verify: VerifierPool.score on {len(items)} rollouts")
    res.pool.score(items[:4])  # workers (if the sources need them) start outside the timing
    seconds, verdicts = _median_time(lambda: res.pool.score(items), repeats)
    return {
        "items": len(items),
        "workers": res.pool.n_workers,
        "seconds": seconds,
        "items_per_s": len(items) / seconds,
        "same_verdicts": count_verdicts(verdicts) == count_verdicts(rewards["verdict"]),
    }


def _bench_parquet(store: Any, scratch: Path, cfg: Any, step: int, repeats: int, progress) -> dict:
    """write_table / read_table (sha256 verified) of each of the step's tables, in a scratch run directory."""
    from coba_tasks.pipeline.config import config_hash, config_to_dict
    from coba_tasks.pipeline.store import RunStore

    progress("parquet: write and read each of the step's tables")
    out = RunStore(scratch)
    out.create(config_to_dict(cfg), config_hash(cfg), {})
    tables = {}
    for name in STEP_TABLES:
        df = store.read_table(step, name)
        write_s, _ = _median_time(lambda df=df, name=name: out.write_table(0, name, df), repeats)
        read_s, back = _median_time(lambda name=name: out.read_table(0, name, verify=True), repeats)
        entry = out.manifest(0)[name]
        tables[name] = {
            "rows": int(entry["rows"]),
            "bytes": int(entry["bytes"]),
            "write_s": write_s,
            "read_s": read_s,
            "round_trip_equal": bool(back.equals(df)),
        }
    return {
        "tables": tables,
        "write_s": sum(t["write_s"] for t in tables.values()),
        "read_s": sum(t["read_s"] for t in tables.values()),
        "bytes": sum(t["bytes"] for t in tables.values()),
    }


def _bench_update(res: Any, rollouts: Any, rewards: Any, scratch: Path, repeats: int, progress) -> dict:
    """PolicyTrainer.update on the step's rollouts (as update_task prepares them), checkpoint save, reload."""
    from coba_tasks.pipeline.policy import InProcessPolicy

    policy = res.policy
    if not isinstance(policy, InProcessPolicy):  # the config was refused before (optim.fsdp_processes=1)
        raise TypeError(f"bench stages times the trainer of this process, not {type(policy).__name__}")
    trainer = policy.trainer
    progress(f"update: PolicyTrainer.update on {len(rollouts)} rollouts")
    t0 = time.perf_counter()
    adv = update_batch.advantages_for(rollouts, rewards)
    prompt_ids, completion_ids, logprobs = update_batch.update_sequences(rollouts, res.prompts)
    prepare_s = time.perf_counter() - t0
    seconds, metrics = _median_time(lambda: trainer.update(prompt_ids, completion_ids, adv, logprobs), repeats)
    ckpt = scratch / "checkpoint"
    save_s, _ = _median_time(lambda: trainer.save_checkpoint(ckpt, extra_state={"bench": True}), repeats)
    version = res.engine.weight_version
    reload_s, _ = _median_time(lambda: res.engine.set_weights(trainer.engine_weights, version=version), repeats)
    tokens = int(metrics["tokens"])
    return {
        "sequences": int(metrics["sequences"]),
        "tokens": tokens,
        "prepare_s": prepare_s,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "checkpoint_save_s": save_s,
        "engine_reload_s": reload_s,
    }


# --- Report


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "-"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.0f} us"
    if abs(s) < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def _load(machine: dict) -> str:
    start, end = machine.get("load_average_at_start"), machine.get("load_average_at_end")
    if not start or not end:
        return ""
    return f", load average {start[0]:.1f} at start, {end[0]:.1f} at end"


def _met(goal: dict) -> str:
    return "met" if goal["met"] else "NOT met"


def format_stages(result: dict) -> str:
    """Human-readable report of ``bench_stages``: the figures, the ratios, their goals and whether met."""
    m, sh, ro, st = result["machine"], result["shape"], result["rollout"], result["step"]
    pq, ve, up, ra, go = result["parquet"], result["verify"], result["update"], result["ratios"], result["goals"]
    g_roll, g_orch = go["rollout_stage_over_bare"], go["orchestration_share"]
    lines = [
        f"Where a training step's time goes ({result['config']}, {result['steps']} steps; "
        f"M = {sh['prompts_per_step']} prompts x G = {sh['group_size']} = {sh['rollouts']} rollouts per step, "
        f"max {sh['max_tokens']} tokens)",
        f"{m['cpus']} CPUs, torch threads {m.get('torch_threads', m['torch_threads_at_start'])}, "
        f"{'CUDA' if m['cuda'] else 'no GPU'}{_load(m)}; medians of {result['repeats']} repeats, steps averaged; "
        "one process, one run: compare the ratios",
        "",
        f"1. Rollout stage vs bare vLLM (step {result['measured_step']}'s prompts, budgets and seeds; "
        f"{ro['completions']} completions, {ro['tokens']:,} tokens)",
        f"  {'bare llm.generate':<34}{_fmt_s(ro['bare_s']):>10}   {ro['bare_tokens_per_s']:,.0f} tokens/s",
        f"  {'bare, asking logprobs=0 as the stage':<34}{_fmt_s(ro['bare_logprobs_s']):>10}",
        f"  {'stages.rollout_table':<34}{_fmt_s(ro['stage_s']):>10}",
        f"  {'Parquet write of rollouts':<34}{_fmt_s(ro['write_s']):>10}",
        f"  stage / bare = {ra['rollout_stage_over_bare']:.3f}x, the median of the repeats' paired ratios (goal <= "
        f"{g_roll['goal']:.2f}: {_met(g_roll)}); "
        f"stage / bare with the stage's requests (logprobs=0) = {ra['rollout_stage_over_bare_same_requests']:.3f}x; "
        f"(stage + write) / bare = {ra['rollout_stage_and_write_over_bare']:.3f}x; "
        f"same completions: {'yes' if ro['same_completions'] else 'NO'}",
        "",
        f"2. One step through the training flow (mean of {result['steps']} steps)",
    ]
    for name in STAGES:
        lines.append(f"  {'stage ' + name:<34}{_fmt_s(st['stage_s'][name]):>10}")
    lines += [
        f"  {'outside the stage bodies (Prefect)':<34}{_fmt_s(st['outside_stages_s']):>10}",
        f"  {'step':<34}{_fmt_s(st['step_s']):>10}",
        f"  Prefect's own time per step (step wall - stage bodies) = {ra['orchestration_share']:.1%} of a step "
        f"(goal <= {g_orch['goal']:.0%}: {_met(g_orch)})",
        "",
        "3. Parquet per step (write = RunStore.write_table, read = read_table with sha256)",
        f"  {'table':<14}{'rows':>8}{'bytes':>12}{'write':>11}{'read':>11}",
    ]
    for name, t in pq["tables"].items():
        lines.append(f"  {name:<14}{t['rows']:>8,}{t['bytes']:>12,}{_fmt_s(t['write_s']):>11}{_fmt_s(t['read_s']):>11}")
    lines += [
        f"  {'total':<14}{'':>8}{pq['bytes']:>12,}{_fmt_s(pq['write_s']):>11}{_fmt_s(pq['read_s']):>11}",
        "",
        f"4. Verification: {ve['items']:,} items in {_fmt_s(ve['seconds'])} = {ve['items_per_s']:,.0f} items/s "
        f"(VerifierPool.score, {ve['workers']} workers); same verdicts as the step: "
        f"{'yes' if ve['same_verdicts'] else 'NO'}",
        "",
        f"5. GRPO update: {up['tokens']:,} completion tokens ({up['sequences']:,} sequences) in "
        f"{_fmt_s(up['seconds'])} = {up['tokens_per_s']:,.0f} tokens/s; tokenizing the prompts "
        f"{_fmt_s(up['prepare_s'])}, checkpoint save {_fmt_s(up['checkpoint_save_s'])}, "
        f"vLLM weight reload {_fmt_s(up['engine_reload_s'])}",
        "",
        "6. Rounds: the step's rollouts sampled in k rounds (each: its part of the prompts, scored, the rounds so "
        "far written), against one",
        *(
            f"  {k} round{'s' if k != '1' else ' '}  {_fmt_s(r['seconds']):>10}"
            + (f"   {_fmt_s(r['per_extra_round_s'])} per round beyond the first" if k != "1" else "")
            for k, r in result["rounds"].items()
        ),
        "",
        f"Goals: rollout stage / bare vLLM <= {g_roll['goal']:.2f}: {_met(g_roll)} "
        f"({g_roll['value']:.3f}); orchestration <= {g_orch['goal']:.0%} of a step: {_met(g_orch)} "
        f"({g_orch['value']:.1%})",
    ]
    return "\n".join(lines)
