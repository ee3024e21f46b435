"""The one-GPU path on CPU: the engine asleep during the update (wiring, records, refusals), the
evaluation's top-p, and the checks of scripts/gpu_check.py on a CPU run directory."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pandas as pd
import pytest
from char_prompts import char_ids, with_char_ids
from scripts_loader import load_script

from coba_tasks.engines import rollout
from coba_tasks.engines.rollout import Rollout, RolloutBackend, SamplingConfig, make_backend
from coba_tasks.engines.rollout.base import _BACKENDS
from coba_tasks.engines.rollout.hf_backend import TransformersBackend
from coba_tasks.engines.rollout.vllm_backend import VLLMBackend
from coba_tasks.engines.update import engine_asleep
from coba_tasks.engines.verify_pool import VerifierPool
from coba_tasks.pipeline import evaluation
from coba_tasks.pipeline.config import check_platform, config_to_dict, load_config
from coba_tasks.pipeline.config_fields import ConfigError
from coba_tasks.pipeline.store import RunStore

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def memory_freed(record: dict[str, Any]) -> float | None:
    """MiB of device memory the engine gave back by sleeping (used before sleep minus used asleep)."""
    before, asleep = record.get("before_sleep"), record.get("asleep")
    if not before or not asleep:
        return None
    return before["used"] - asleep["used"]


# ---------------------------------------------------------------------------------------------
# engine_asleep


class _Engine:
    def __init__(self) -> None:
        self.events: list[str] = []

    def sleep(self) -> None:
        self.events.append("sleep")

    def wake_up(self) -> None:
        self.events.append("wake")


def _probes(events: list[str]):
    used = iter([9000.0, 1000.0, 3000.0, 9500.0])

    def memory():
        events.append("memory")
        return {"used": next(used), "total": 10000.0, "peak_allocated": 2000.0}

    return {
        "memory": memory,
        "release": lambda: events.append("release"),
        "reset_peak": lambda: events.append("reset_peak"),
    }


def test_engine_asleep_sleeps_for_the_body_then_wakes_and_records():
    engine = _Engine()
    with engine_asleep(engine, True, **_probes(engine.events)) as record:
        engine.events.append("update")
    assert engine.events == [
        "memory",
        "sleep",
        "reset_peak",
        "memory",
        "update",
        "memory",
        "release",  # the update's cached blocks go back to the device before the engine takes its memory
        "wake",
        "memory",
    ]
    assert [record[k]["used"] for k in ("before_sleep", "asleep", "after_update", "awake")] == [9000, 1000, 3000, 9500]
    assert record["sleep_s"] >= 0 and record["wake_s"] >= 0
    assert memory_freed(record) == 8000
    json.dumps(record)  # written as engine_sleep.json


def test_engine_asleep_off_does_nothing_and_an_error_still_wakes():
    engine = _Engine()
    with engine_asleep(engine, False, **_probes(engine.events)) as record:
        engine.events.append("update")
    assert engine.events == ["update"] and record == {}
    with pytest.raises(RuntimeError, match="out of memory"), engine_asleep(engine, True, **_probes([])):
        raise RuntimeError("out of memory")
    assert engine.events[-2:] == ["sleep", "wake"]
    # without CUDA the figures are null
    with engine_asleep(_Engine(), True, memory=lambda: None) as record:
        pass
    assert record["before_sleep"] is None and memory_freed(record) is None


# ---------------------------------------------------------------------------------------------
# VLLMBackend: sleep, wake, refusal on CPU (no engine started)


class _FakeLLM:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append(f"{method}({kwargs['weights_path']})")

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append("generate")
        out = SimpleNamespace(
            text="7", token_ids=[5], finish_reason="stop", logprobs=[{5: SimpleNamespace(logprob=-0.5)}]
        )
        return [SimpleNamespace(outputs=[out] * p.n) for p in params]


def _vllm_without_engine(sleep_mode: bool = True) -> tuple[VLLMBackend, _FakeLLM]:
    backend = object.__new__(VLLMBackend)
    rollout.RolloutBackend.__init__(backend)
    fake = _FakeLLM()
    backend.__dict__.update(
        _llm=fake,
        _llm_kwargs={"enable_sleep_mode": True} if sleep_mode else {},
        _asleep=False,
        _closed=False,
        _weights_path=None,
        restarts=0,
    )
    return backend, fake


def test_vllm_sleep_wake_and_reload_order():
    backend, fake = _vllm_without_engine()
    backend.sleep()
    backend.sleep()  # already asleep: nothing more
    backend.wake_up()
    backend.wake_up()
    assert fake.calls == ["sleep(1)", "wake_up"]
    fake.calls.clear()
    backend.sleep()
    backend.load_weights("ckpt/000001", version=1)  # wakes first; the prefix cache is dropped after the reload
    assert fake.calls == ["sleep(1)", "wake_up", "coba_reload_weights(ckpt/000001)", "reset_prefix_cache"]
    assert backend.weight_version == 1
    fake.calls.clear()
    backend.sleep()
    rows = backend.generate([rollout.RolloutRequest("p", char_ids("1+6="), 2, 3)], SamplingConfig())
    assert fake.calls == ["sleep(1)", "wake_up", "generate"] and len(rows) == 2


def test_vllm_sleep_needs_sleep_mode():
    backend, fake = _vllm_without_engine(sleep_mode=False)
    with pytest.raises(RuntimeError, match="without sleep_mode=True"):
        backend.sleep()
    backend.wake_up()  # awake already: a no-op
    assert fake.calls == []


def test_vllm_sleep_mode_is_refused_on_cpu_before_an_engine_starts(random_checkpoints, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sleep mode needs a CUDA GPU"):
        make_backend("vllm", random_checkpoints[0], sleep_mode=True)
    assert rollout.sleep_unavailable("vllm") and rollout.sleep_unavailable("transformers") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert rollout.sleep_unavailable("vllm") is None


def test_check_platform_refuses_sleep_without_cuda_in_one_line(monkeypatch):
    import torch

    cfg = load_config(overrides=["rollout.sleep_during_update=true"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        check_platform(cfg)
    message = str(err.value)
    assert message.startswith("rollout.sleep_during_update = true: vLLM's sleep mode needs a CUDA GPU")
    assert "\n" not in message and "set rollout.sleep_during_update=false" in message
    check_platform(load_config())  # off: nothing to refuse
    check_platform(load_config(overrides=["rollout.sleep_during_update=true", "rollout.backend=transformers"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_platform(cfg)


# ---------------------------------------------------------------------------------------------
# Held-out evaluation: top-p of the sampled evaluation


class _RecordingEngine(RolloutBackend):
    def __init__(self) -> None:
        super().__init__()
        self.weight_version = 4
        self.samplings: list[SamplingConfig] = []

    def load_weights(self, path, version) -> None:
        self.weight_version = version

    def set_weights(self, source, version) -> None:
        self.weight_version = version

    def close(self) -> None:
        return None

    def generate(self, requests, sampling):
        self.samplings.append(sampling)
        return [
            Rollout(r.prompt_id, j, "3", (5,), 1, "stop", r.seed, self.weight_version)
            for r in requests
            for j in range(r.n)
        ]


def test_evaluate_samples_with_eval_top_p_and_decodes_greedy_without_it():
    test = with_char_ids(
        pd.DataFrame(
            {
                "prompt_id": ["a", "b"],
                "prompt_text": ["1+2=", "2+2="],
                "ground_truth": ["3", "4"],
                "data_source": "arith",
            }
        )
    )
    engine = _RecordingEngine()
    with VerifierPool(workers=1, timeout_s=5.0) as pool:  # arith is scored in-process: no worker starts
        table = evaluation.evaluate(test, engine, pool, 4, 1.0, 8, seed=0, greedy=True, top_p=0.9)
    assert [(s.temperature, s.top_p) for s in engine.samplings] == [(1.0, 0.9), (0.0, 1.0)]
    assert table["accuracy"].tolist() == [1.0, 0.0] and table["weight_version"].tolist() == [4, 4]
    assert table["answered"].tolist() == [1.0, 1.0]  # "3" for 2+2 is wrong, but an answer


class _GivingUpEngine(_RecordingEngine):
    """Answers "4" to every other sample and gives up ("?") on the rest."""

    def generate(self, requests, sampling):
        return [
            Rollout(r.prompt_id, j, "4" if j % 2 else "?", (5,), 1, "stop", r.seed, self.weight_version)
            for r in requests
            for j in range(r.n)
        ]


def test_evaluate_counts_the_completions_that_give_an_answer():
    test = with_char_ids(
        pd.DataFrame({"prompt_id": ["a", "b"], "prompt_text": ["1+3=", "2+3="], "ground_truth": ["4", "5"]})
    )
    test["data_source"] = "arith"
    with VerifierPool(workers=1, timeout_s=5.0) as pool:
        table = evaluation.evaluate(test, _GivingUpEngine(), pool, 4, 1.0, 8, seed=0)
    assert table["answered"].tolist() == [0.5, 0.5]  # "?" is no_answer; "4" is an answer, right or wrong
    assert table["accuracy"].tolist() == [0.5, 0.0]


# ---------------------------------------------------------------------------------------------
# The training flow with a fake backend: sleep before the update, wake before the reload


class SleepyBackend(TransformersBackend):
    """The transformers backend, recording what the flow asks of it; refuses work while asleep."""

    events: ClassVar[list[tuple]] = []
    current: ClassVar[SleepyBackend | None] = None

    def __init__(self, model_path, *, sleep_mode: bool = False, **options) -> None:
        super().__init__(model_path, **options)
        self.sleep_mode, self.asleep = sleep_mode, False
        SleepyBackend.current = self

    def generate(self, requests, sampling):
        assert not self.asleep, "generate on a sleeping engine"
        self.events.append(("generate", self.weight_version, sampling.temperature, sampling.top_p))
        return super().generate(requests, sampling)

    def sleep(self) -> None:
        assert self.sleep_mode, "sleep() without sleep_mode"
        self.asleep = True
        self.events.append(("sleep", self.weight_version))

    def wake_up(self) -> None:
        self.asleep = False
        self.events.append(("wake", self.weight_version))

    def load_weights(self, path, version: int) -> None:
        assert not self.asleep, "weights loaded into a sleeping engine"
        self.events.append(("load", version))
        super().load_weights(path, version)

    def set_weights(self, source, version: int) -> None:
        assert not self.asleep, "weights loaded into a sleeping engine"
        self.events.append(("load", version))
        super().set_weights(source, version)


@pytest.fixture(scope="module")
def sleepy_run(tmp_path_factory, prefect_harness, random_checkpoints):
    """A 3-step run of the training flow on the fake backend with rollout.sleep_during_update on."""
    from coba_tasks.engines.update import PolicyTrainer
    from flows.train import train_flow

    original_update = PolicyTrainer.update

    def update(self, *args, **kwargs):
        SleepyBackend.events.append(("update", SleepyBackend.current.asleep))
        return original_update(self, *args, **kwargs)

    SleepyBackend.events = []
    run_dir = tmp_path_factory.mktemp("sleepy") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_BACKENDS, "sleepy", SleepyBackend)
        mp.setattr(PolicyTrainer, "update", update)
        cfg = load_config(
            ROOT / "configs/tiny-test.yaml",
            [
                f"model.path={random_checkpoints[0]}",
                "data.train_prompts=6",
                f"run.steps={STEPS}",
                "run.eval_samples=2",
                "run.eval_temperature=1.0",
                "run.eval_top_p=0.9",
                "data.eval_prompts=4",
                "rollout.backend=sleepy",
                "rollout.sleep_during_update=true",
            ],
        )
        train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    return run_dir, list(SleepyBackend.events)


@pytest.mark.slow
def test_flow_sleeps_the_engine_for_the_update_and_wakes_it_before_the_reload(sleepy_run):
    run_dir, events = sleepy_run
    updates = [i for i, e in enumerate(events) if e[0] == "update"]
    assert len(updates) == STEPS
    for step, i in enumerate(updates):
        assert events[i - 1] == ("sleep", step)
        assert events[i] == ("update", True)  # the trainer ran while the engine slept
        assert events[i + 1 : i + 3] == [("wake", step), ("load", step + 1)]
    rollouts = [e for e in events if e[0] == "generate" and e[2:] == (1.0, 1.0)]  # rollout.top_p is 1.0
    evals = [e for e in events if e[0] == "generate" and e[2:] == (1.0, 0.9)]  # run.eval_top_p
    greedy = [e for e in events if e[0] == "generate" and e[2] == 0.0]
    assert [e[1] for e in evals] == [0, STEPS] and [e[1] for e in greedy] == [0, STEPS]
    assert sorted({e[1] for e in rollouts}) == list(range(STEPS))
    for step in range(STEPS):
        record = json.loads((run_dir / f"steps/{step:06d}/engine_sleep.json").read_text())
        assert record["sleep_s"] >= 0 and record["wake_s"] >= 0
        assert record["before_sleep"] is None and record["awake"] is None  # no CUDA here
    store = RunStore.open(run_dir)
    assert store.read_config()["rollout"]["sleep_during_update"] is True


@pytest.mark.slow
def test_gpu_check_checks_pass_on_a_cpu_run_and_catch_a_missing_step(sleepy_run):
    run_dir, _ = sleepy_run
    gpu_check = load_script("scripts/gpu_check.py")
    checks = gpu_check.check_run(run_dir, STEPS, require_memory=False)
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    names = {c.name for c in checks}
    assert {f"step {s} tables" for s in range(STEPS)} <= names and "step 2 weight version" in names
    more = gpu_check.check_run(run_dir, STEPS + 1, require_memory=False)
    failed = [c for c in more if not c.ok]
    assert [c.name for c in failed] == ["step 3 tables", "eval at step 4"]
    assert "missing budget, rollouts, rewards, capability, update" in failed[0].detail  # step 3 never started
    # the memory check needs CUDA figures: a CPU run has none, and that fails it
    memory = gpu_check.check_run(run_dir, 1, require_memory=True)
    assert [c.ok for c in memory if c.name == "step 0 memory"] == [False]


def test_gpu_check_memory_check_wants_memory_freed_and_taken_back():
    gpu_check = load_script("scripts/gpu_check.py")

    def record(before, asleep, after, awake):
        return {
            "before_sleep": {"used": before, "total": 100.0},
            "asleep": {"used": asleep},
            "after_update": {"used": after, "peak_allocated": 10.0},
            "awake": {"used": awake},
            "sleep_s": 0.5,
            "wake_s": 0.7,
        }

    assert gpu_check.check_memory(record(80, 30, 40, 85), min_freed_mib=40).ok
    assert not gpu_check.check_memory(record(80, 70, 75, 85), min_freed_mib=40).ok  # sleeping freed too little
    assert not gpu_check.check_memory(record(80, 30, 40, 45), min_freed_mib=40).ok  # waking took nothing back
    assert not gpu_check.check_memory({"before_sleep": None}, min_freed_mib=40).ok


def test_gpu_check_config_is_valid_and_asks_for_sleep(tmp_path):
    gpu_check = load_script("scripts/gpu_check.py")
    path = gpu_check.write_config(tmp_path / "c.yaml", tmp_path / "model")
    cfg = load_config(path)
    assert cfg.rollout.sleep_during_update and cfg.rollout.backend == "vllm" and cfg.run.steps == 3
    assert (cfg.run.eval_temperature, cfg.run.eval_top_p) == (1.0, 0.9) and cfg.model.dtype == "bfloat16"
