"""The vllm-ray backend: sharding by budget, the config key, and two Ray engines against one vLLM engine."""

from __future__ import annotations

import random

import pytest
from char_prompts import char_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, backends, make_backend, rollout_seed
from coba_tasks.engines.rollout.ray_backend import shard_by_budget, shard_indices
from coba_tasks.pipeline.config import HASH_NEUTRAL_DEFAULTS, apply_overrides, config_hash, load_config
from coba_tasks.pipeline.config_fields import ConfigError


def reqs(budgets: list[int], step: int = 0) -> list[RolloutRequest]:
    return [
        RolloutRequest(f"p{i:02d}", char_ids(f"{7 * i + 3}+{5 * i % 9}="), n=n, seed=rollout_seed(7, step, f"p{i}"))
        for i, n in enumerate(budgets)
    ]


def totals(shards: list[list[RolloutRequest]]) -> list[int]:
    return [sum(r.n for r in s) for s in shards]


def contents(shards: list[list[RolloutRequest]]) -> list[list[str]]:
    return [sorted(r.prompt_id for r in s) for s in shards]


# ---------------------------------------------------------------------------------------------
# shard_by_budget


def test_shards_by_hand():
    # largest first onto the least loaded: 16 -> A, 9 -> B, 8 -> B (17), 5 -> A (21), 3 -> B (20), 2 -> B (22)
    shards = shard_by_budget(reqs([16, 2, 9, 5, 8, 3]), 2)
    assert contents(shards) == [["p00", "p03"], ["p01", "p02", "p04", "p05"]]
    assert totals(shards) == [21, 22]
    assert [r.prompt_id for r in shards[1]] == ["p01", "p02", "p04", "p05"]  # input order within a shard
    assert shard_by_budget(reqs([4, 4, 4, 4]), 4) == [[r] for r in reqs([4, 4, 4, 4])]
    assert shard_by_budget(reqs([5]), 1) == [reqs([5])]


def test_fewer_requests_than_shards_and_no_requests():
    assert totals(shard_by_budget(reqs([3, 7]), 4)) == [7, 3, 0, 0]
    assert shard_by_budget([], 3) == [[], [], []]


def test_bad_arguments_are_refused():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="n_shards must be an int >= 1"):
            shard_by_budget(reqs([2, 3]), bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group size must be >= 1"):
        shard_by_budget([*reqs([2]), RolloutRequest("bad", char_ids("1+1="), 0, 0)], 2)


def test_shards_do_not_depend_on_the_input_order():
    budgets = [16, 2, 9, 5, 12, 3, 7, 14, 4, 10, 6, 8, 9, 2, 16]
    base = reqs(budgets)
    expected = contents(shard_by_budget(base, 3))
    rng = random.Random(0)
    for _ in range(20):
        shuffled = base[:]
        rng.shuffle(shuffled)
        assert contents(shard_by_budget(shuffled, 3)) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 128), max_size=60),
    st.integers(1, 9),
    st.randoms(use_true_random=False),
)
def test_sharding_properties(budgets, n_shards, rng):
    requests = reqs(budgets)
    idx = shard_indices(requests, n_shards)
    shards = shard_by_budget(requests, n_shards)
    assert len(shards) == n_shards
    # every request exactly once, whole, in input order within its shard
    assert sorted(i for s in idx for i in s) == list(range(len(requests)))
    assert all(s == sorted(s) for s in idx)
    assert shards == [[requests[i] for i in s] for s in idx]
    # balance: the totals differ by at most the largest single budget (LPT bound), and sum to the budget
    t = totals(shards)
    assert sum(t) == sum(budgets)
    assert max(t) - min(t) <= max(budgets, default=0)
    # deterministic, and the contents do not depend on the input order
    assert shard_by_budget(requests, n_shards) == shards
    shuffled = requests[:]
    rng.shuffle(shuffled)
    assert contents(shard_by_budget(shuffled, n_shards)) == contents(shards)


# ---------------------------------------------------------------------------------------------
# Registry, config key, and how the training flow passes it


def test_registered_and_configurable():
    assert "vllm-ray" in backends()
    cfg = load_config(None, ["rollout.backend=vllm-ray", "rollout.engines=4"])
    assert (cfg.rollout.backend, cfg.rollout.engines) == ("vllm-ray", 4)
    assert load_config().rollout.engines == 1
    with pytest.raises(ConfigError, match=r"^rollout\.engines = 0: must be >= 1"):
        load_config(None, ["rollout.backend=vllm-ray", "rollout.engines=0"])
    with pytest.raises(ConfigError, match=r"^rollout\.engines = 2: must be 1 with rollout\.backend=vllm: only"):
        load_config(None, ["rollout.engines=2"])
    with pytest.raises(ConfigError, match=r"^rollout\.engines: expected an integer"):
        load_config(None, ["rollout.backend=vllm-ray", "rollout.engines=two"])
    # added after runs existed: at 1 it is left out of the hash (older runs keep theirs)
    assert HASH_NEUTRAL_DEFAULTS[("rollout", "engines")] == 1
    ray_cfg = apply_overrides(load_config(), ["rollout.backend=vllm-ray"])
    assert config_hash(apply_overrides(ray_cfg, ["rollout.engines=2"])) != config_hash(ray_cfg)


def test_training_flow_passes_engines_to_vllm_ray_only(monkeypatch):
    from coba_tasks.pipeline import run

    seen: list[tuple[str, dict]] = []

    class Stop(Exception):
        pass

    def fake_make_backend(name, path, **options):
        seen.append((name, options))
        raise Stop

    monkeypatch.setattr(run, "make_backend", fake_make_backend)
    for overrides in (["rollout.backend=vllm-ray", "rollout.engines=3"], []):
        res = run.RunResources(cfg=load_config(None, overrides), store=None, prompts=None, test=None)
        with pytest.raises(Stop):
            res.start("models/x", version=0)
    assert seen[0][0] == "vllm-ray" and seen[0][1]["engines"] == 3
    assert seen[1][0] == "vllm" and "engines" not in seen[1][1]


def test_bad_engines_option_is_refused_before_ray_starts(random_checkpoints):
    a, _ = random_checkpoints
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="engines must be an int >= 1"):
            make_backend("vllm-ray", a, engines=bad)


# ---------------------------------------------------------------------------------------------
# Two engines in Ray (local, CPU) against one vLLM engine

BUDGETS = [16, 2, 9, 5, 12, 3, 7, 14, 4, 10, 6, 8]  # 12 prompts, 96 rollouts: 48 per engine
SAMPLE = SamplingConfig(temperature=1.0, max_tokens=8)
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
ENGINE = {"dtype": "float32", "max_model_len": 64, "seed": 0}


def key(rows):
    return [(r.prompt_id, r.sample_idx, r.token_ids, r.completion, r.seed, r.weight_version) for r in rows]


@pytest.mark.slow
def test_two_ray_engines_give_the_rows_of_one_engine_before_and_after_a_reload(random_checkpoints, monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local Ray instance, started and stopped here
    a, b = random_checkpoints
    requests = reqs(BUDGETS)
    assert totals(shard_by_budget(requests, 2)) == [48, 48]

    single = make_backend("vllm", a, **ENGINE)
    try:
        want_a = single.generate(requests, SAMPLE)
        want_greedy = single.generate(requests[:4], GREEDY)
        single.load_weights(b, version=1)
        want_b = single.generate(requests, SAMPLE)
    finally:
        single.close()
    assert key(want_a) != key(want_b)  # the weights matter
    assert len(want_a) == sum(BUDGETS)

    assert not ray.is_initialized()
    backend = make_backend("vllm-ray", a, engines=2, **ENGINE)
    try:
        assert backend.engines == 2 and len(set(backend.engine_pids)) == 2  # two actor processes
        assert key(backend.generate(requests, SAMPLE)) == key(want_a)
        assert key(backend.generate(requests[:4], GREEDY)) == key(want_greedy)
        assert backend.generate([], SAMPLE) == []

        backend.load_weights(b, version=1)
        got_b = backend.generate(requests, SAMPLE)
        assert key(got_b) == key(want_b) and {r.weight_version for r in got_b} == {1}
        backend.load_weights(a, version=0)
        from safetensors.torch import load_file

        b_tensors = load_file(str(b / "model.safetensors"))
        backend.set_weights(lambda: b_tensors.items(), version=1)  # from memory, through Ray's object store
        assert key(backend.generate(requests, SAMPLE)) == key(want_b)

        # an engine's actor dies: a new one starts on the last weights given and its share is run again
        old_pid = backend.engine_pids[0]
        ray.kill(backend._actors[0], no_restart=True)
        assert key(backend.generate(requests, SAMPLE)) == key(want_b)
        assert backend.restarts == 1 and backend.engine_pids[0] != old_pid
    finally:
        backend.close()
    assert not ray.is_initialized()  # the backend started Ray, so it stopped it
    with pytest.raises(RuntimeError, match="closed"):
        backend.generate(requests, SAMPLE)
