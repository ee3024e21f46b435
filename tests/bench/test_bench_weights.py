"""``coba bench weights`` on the tiny random model: the figures' structure and what must hold whatever the
machine (no timings asserted)."""

from __future__ import annotations

import pytest

from coba_tasks.bench.weights_bench import bench_case, bench_weights, format_weights


@pytest.mark.slow
def test_bench_weights_figures(tmp_path, random_checkpoints):
    from coba_tasks.engines.rollout import make_backend

    a, _ = random_checkpoints
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0)
    try:
        cases = [{"model": "tiny", **bench_case(engine, a, rank, tmp_path, repeats=1)} for rank in (4, 0)]
    finally:
        engine.close()
    lora, full = cases
    for c in cases:
        assert c["memory_bytes"] == 0 < c["file_bytes"] and c["checkpoint_bytes"] > 0  # from memory: no file
        assert c["memory_s"] > 0 and c["file_s"] > 0 and c["memory_over_file"] == c["memory_s"] / c["file_s"]
        assert c["parameters"] > 0 and engine.weight_version == 1
    assert lora["checkpoint_bytes"] < full["checkpoint_bytes"] / 2  # an adapter's checkpoint, not the model's
    assert full["file_bytes"] == full["checkpoint_bytes"]  # full fine-tuning: the engine read the checkpoint
    # the digest covers what is trained: LoRA's adapters, every parameter of full fine-tuning
    assert 0 < lora["trained_parameters"] < full["trained_parameters"] == full["parameters"]
    assert all(c["digest_s"] > 0 and c["update_s"] > 0 for c in cases)
    table = format_weights({"repeats": 1, "torch_threads": 2, "cases": cases})
    assert len(table.splitlines()) == 2 + len(cases) + 2 + 2 + len(cases) + 2 and "LoRA 4" in table and "full" in table


def test_bench_weights_refuses_when_it_has_no_model(tmp_path):
    with pytest.raises(ValueError, match=r"no model to time: .*nowhere is not a model directory"):
        bench_weights(smollm2=str(tmp_path / "nowhere"), qwen_05b=False)
