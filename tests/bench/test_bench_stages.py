"""``coba bench stages`` on the tiny config: the figures' structure and internal consistency (no timings)."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from coba_tasks.bench.stages_bench import GOALS, STEP_TABLES, format_stages
from coba_tasks.pipeline.store import STAGES


def _numbers(obj, path=""):
    """Every int or float in a nested result, with its path (bools left out)."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, int | float):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.slow
def test_bench_stages_figures_are_consistent(tmp_path, prefect_harness, random_checkpoints):
    from coba_tasks.bench.stages_bench import bench_stages
    from coba_tasks.pipeline.store import RunStore

    model, _ = random_checkpoints
    messages = []
    from flows.train import train_flow

    summaries = []

    def train(cfg, run_dir):
        summaries.append(train_flow(config=cfg, run_dir=run_dir))
        return summaries[-1]

    result = bench_stages(
        train,
        "configs/tiny-test.yaml",
        [f"model.path={model}", "data.train_prompts=8"],
        steps=2,
        progress=messages.append,
        repeats=2,
        work_dir=tmp_path,
    )
    assert messages and result == json.loads(json.dumps(result))  # JSON-serialisable as is

    # shape: what the step produced
    m, g = 4, 4  # configs/tiny-test.yaml
    sh, ro, st, pq, ve, up = (result[k] for k in ("shape", "rollout", "step", "parquet", "verify", "update"))
    assert result["steps"] == 2 and result["measured_step"] == 1
    assert sh["prompts_per_step"] == m and sh["group_size"] == g and sh["rollouts"] == m * g
    trained = RunStore.open(tmp_path / "run")  # the run the training flow wrote
    rollouts = trained.read_table(1, "rollouts")
    assert sh["completion_tokens"] == int(rollouts["n_tokens"].sum())
    assert ro["prompts"] == m and ro["completions"] == m * g and ro["tokens"] > 0
    assert ve["items"] == m * g and ve["same_verdicts"]
    assert up["sequences"] == m * g and up["tokens"] == sh["completion_tokens"]
    assert set(pq["tables"]) == set(STEP_TABLES)
    assert pq["tables"]["rollouts"]["rows"] == m * g and pq["tables"]["rewards"]["rows"] == m * g
    assert pq["tables"]["budget"]["rows"] == m and pq["tables"]["capability"]["rows"] == 1
    assert pq["tables"]["update"]["rows"] == 1
    for name, t in pq["tables"].items():
        assert t["bytes"] == trained.manifest(1)[name]["bytes"]
        assert t["round_trip_equal"]
    assert pq["bytes"] == sum(t["bytes"] for t in pq["tables"].values())
    assert math.isclose(pq["write_s"], sum(t["write_s"] for t in pq["tables"].values()))
    assert math.isclose(pq["read_s"], sum(t["read_s"] for t in pq["tables"].values()))
    # the step's figures are the flow's own: its summary and each step's timing.json
    (summary,) = summaries
    assert st["step_s"] == summary["step_seconds_mean"]
    assert st["outside_stages_s"] == summary["prefect_overhead_seconds_per_step"]
    timings = [json.loads((tmp_path / "run" / "steps" / f"{t:06d}" / "timing.json").read_text()) for t in (0, 1)]
    assert set(st["stage_s"]) == set(STAGES)
    for name in STAGES:
        assert math.isclose(st["stage_s"][name], statistics.mean(timing[name] for timing in timings))
    assert ro["write_s"] == pq["tables"]["rollouts"]["write_s"]

    # every figure is finite; every time, count and rate non-negative; the benchmark reports times, it
    # does not judge them
    for path, value in _numbers(result):
        assert math.isfinite(value), path
        assert value >= 0, path
    assert result["machine"]["cpus"] >= 1 and result["machine"]["torch_threads"] >= 1

    # ratios are the quotients of the figures they come from
    ra = result["ratios"]
    pairs = list(zip(ro["stage_repeats_s"], ro["bare_repeats_s"], strict=True))  # the repeats, side by side
    assert ro["stage_s"] == statistics.median(ro["stage_repeats_s"])
    assert ro["bare_s"] == statistics.median(ro["bare_repeats_s"])
    assert ra["rollout_stage_over_bare"] == ro["paired_ratio"] == statistics.median(a / b for a, b in pairs)
    same = zip(ro["stage_repeats_s"], ro["bare_logprobs_repeats_s"], strict=True)  # the stage's own requests
    assert ra["rollout_stage_over_bare_same_requests"] == statistics.median(a / b for a, b in same)
    assert ro["bare_logprobs_s"] == statistics.median(ro["bare_logprobs_repeats_s"])
    assert ra["rollout_stage_and_write_over_bare"] == (ro["stage_s"] + ro["write_s"]) / ro["bare_s"]
    assert ra["orchestration_share"] == st["outside_stages_s"] / st["step_s"]
    assert ro["bare_tokens_per_s"] == ro["tokens"] / ro["bare_s"]
    assert ve["items_per_s"] == ve["items"] / ve["seconds"]
    assert up["tokens_per_s"] == up["tokens"] / up["seconds"]
    rounds = result["rounds"]  # the step's rollouts in 1, 2 and 4 rounds: the cost of each round past the first
    assert sorted(rounds, key=int) == ["1", "2", "4"] and rounds["1"]["per_extra_round_s"] == 0.0
    for k in (2, 4):
        extra = (rounds[str(k)]["seconds"] - rounds["1"]["seconds"]) / (k - 1)
        assert math.isclose(rounds[str(k)]["per_extra_round_s"], extra)
    for name, limit in GOALS.items():
        goal = result["goals"][name]
        assert goal["goal"] == limit and goal["value"] == ra[name] and goal["met"] == (ra[name] <= limit)

    # the report shows every ratio, every goal and whether it is met
    text = format_stages(result)
    for snippet in (
        f"{ra['rollout_stage_over_bare']:.3f}x",
        f"{ra['rollout_stage_over_bare_same_requests']:.3f}x",
        f"{ra['rollout_stage_and_write_over_bare']:.3f}x",
        f"{ra['orchestration_share']:.1%}",
        "goal <= 1.10",
        "goal <= 10%",
        f"{ve['items_per_s']:,.0f} items/s",
        f"{up['tokens_per_s']:,.0f} tokens/s",
    ):
        assert snippet in text, snippet
    assert text.count("NOT met") == sum(not g["met"] for g in result["goals"].values()) * 2
    for name in (*STAGES, *STEP_TABLES):
        assert name in text


def _no_train(cfg, run_dir):
    raise AssertionError("a refused benchmark trains nothing")


def test_bench_stages_refuses_bad_input():
    from coba_tasks.bench.stages_bench import bench_stages

    with pytest.raises(ValueError, match="steps must be a positive integer"):
        bench_stages(_no_train, "configs/tiny-test.yaml", steps=0, progress=lambda s: None)
    with pytest.raises(ValueError, match=r"needs rollout\.backend=vllm"):
        bench_stages(
            _no_train, "configs/tiny-test.yaml", ["rollout.backend=transformers"], steps=1, progress=lambda s: None
        )
    with pytest.raises(ValueError, match=r"needs optim\.fsdp_processes=1, got 2"):
        bench_stages(_no_train, "configs/tiny-test.yaml", ["optim.fsdp_processes=2"], steps=1, progress=lambda s: None)
    with pytest.raises(ValueError, match="does not exist"):
        bench_stages(_no_train, "configs/no-such.yaml", steps=1, progress=lambda s: None)
