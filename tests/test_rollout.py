"""Rollout backends: vLLM on CPU against transformers, reloads, per-prompt n, seeds."""

from __future__ import annotations

import pytest

from coba_tasks.rollout import (
    RolloutRequest,
    SamplingConfig,
    backends,
    make_backend,
    rollout_seed,
)

PROMPTS = ["37+58=", "1+2=", "99*9=", "(4-7)*3=", "12+"]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
SAMPLE = SamplingConfig(temperature=1.0, max_tokens=8)


def requests(n: int | list[int], seed_step: int = 0) -> list[RolloutRequest]:
    sizes = n if isinstance(n, list) else [n] * len(PROMPTS)
    return [
        RolloutRequest(prompt_id=f"p{i}", prompt=p, n=k, seed=rollout_seed(7, seed_step, f"p{i}"))
        for i, (p, k) in enumerate(zip(PROMPTS, sizes, strict=True))
    ]


@pytest.fixture(scope="module")
def vllm_engine(random_checkpoints):
    a, _ = random_checkpoints
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0)
    yield engine
    engine.close()


def test_registry_and_bad_input(tmp_path):
    assert backends() == ["transformers", "vllm", "vllm-ray"]
    with pytest.raises(ValueError, match=r"unknown rollout backend 'sglang'.*transformers, vllm"):
        make_backend("sglang", tmp_path)
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        make_backend("transformers", tmp_path)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)


def test_rollout_seed_is_stable_and_distinct():
    assert rollout_seed(1, 2, "a") == rollout_seed(1, 2, "a")
    seeds = {rollout_seed(1, s, p) for s in range(20) for p in ("a", "b", "c")}
    assert len(seeds) == 60
    assert all(0 <= s < 2**31 for s in seeds)


@pytest.mark.slow
def test_vllm_greedy_equals_transformers_then_follows_reloaded_weights(vllm_engine, random_checkpoints):
    a, b = random_checkpoints
    hf = make_backend("transformers", a)
    v_rows = vllm_engine.generate(requests(1), GREEDY)
    h_rows = hf.generate(requests(1), GREEDY)
    assert [r.token_ids for r in v_rows] == [r.token_ids for r in h_rows]
    assert [r.completion for r in v_rows] == [r.completion for r in h_rows]
    assert {r.weight_version for r in v_rows} == {0}

    vllm_engine.load_weights(b, version=3)
    hf_b = make_backend("transformers", b)
    v_rows_b = vllm_engine.generate(requests(1), GREEDY)
    h_rows_b = hf_b.generate(requests(1), GREEDY)
    assert [r.token_ids for r in v_rows_b] == [r.token_ids for r in h_rows_b]
    assert [r.token_ids for r in v_rows_b] != [r.token_ids for r in v_rows]  # the weights did change
    assert {r.weight_version for r in v_rows_b} == {3}
    vllm_engine.load_weights(a, version=0)
    assert [r.token_ids for r in vllm_engine.generate(requests(1), GREEDY)] == [r.token_ids for r in v_rows]


@pytest.mark.slow
def test_vllm_per_prompt_group_sizes_and_seeds(vllm_engine):
    sizes = [2, 7, 3, 16, 5]
    rows = vllm_engine.generate(requests(sizes), SAMPLE)
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r.prompt_id, []).append(r.sample_idx)
    assert [len(by_prompt[f"p{i}"]) for i in range(5)] == sizes
    assert all(v == list(range(len(v))) for v in by_prompt.values())
    assert all(r.n_tokens == len(r.token_ids) and r.finish_reason in ("stop", "length") for r in rows)
    again = vllm_engine.generate(requests(sizes), SAMPLE)
    assert [r.token_ids for r in again] == [r.token_ids for r in rows]  # same seeds, same completions
    # a prompt's group does not depend on the other prompts in the batch
    alone = vllm_engine.generate(requests(sizes)[3:4], SAMPLE)
    assert [r.token_ids for r in alone] == [r.token_ids for r in rows if r.prompt_id == "p3"]
    other_step = vllm_engine.generate(requests(sizes, seed_step=1), SAMPLE)
    assert [r.token_ids for r in other_step] != [r.token_ids for r in rows]
    assert len({r.token_ids for r in rows if r.prompt_id == "p3"}) > 1  # samples within a group differ


def test_transformers_backend_group_sizes_and_seeds(random_checkpoints):
    a, _ = random_checkpoints
    hf = make_backend("transformers", a)
    sizes = [2, 3, 1, 4, 2]
    rows = hf.generate(requests(sizes), SAMPLE)
    assert [sum(r.prompt_id == f"p{i}" for r in rows) for i in range(5)] == sizes
    assert [r.token_ids for r in hf.generate(requests(sizes), SAMPLE)] == [r.token_ids for r in rows]
    alone = hf.generate(requests(sizes)[3:4], SAMPLE)
    assert [r.token_ids for r in alone] == [r.token_ids for r in rows if r.prompt_id == "p3"]


@pytest.mark.slow
def test_vllm_reload_drops_the_prefix_cache(random_checkpoints):
    """A prompt that fills a KV block leaves it in vLLM's prefix cache; those blocks were computed with
    the old weights, so after a reload they must not be reused (32-token blocks: the CPU's smallest)."""
    a, b = random_checkpoints
    long_prompt = [RolloutRequest("long", "12+34+56+78+90+12+34+56+78+90+11+22+33+44=", 1, 0)]  # 42 tokens
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0, extra={"block_size": 32})
    try:
        engine.generate(long_prompt, GREEDY)
        engine.load_weights(b, version=1)
        after = engine.generate(long_prompt, GREEDY)
    finally:
        engine.close()
    expected = make_backend("transformers", b).generate(long_prompt, GREEDY)
    assert after[0].token_ids == expected[0].token_ids
