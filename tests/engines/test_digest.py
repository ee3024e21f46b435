"""The weights digest a replay must give again (``coba_tasks.engines.digest``), and the update's repeatable setup:
deterministic kernels on CUDA, the operations that ran without one, cuBLAS's workspace setting."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from coba_tasks.engines import digest
from coba_tasks.engines.digest import params_digest, tensor_sums
from coba_tasks.engines.update import CUBLAS_CONFIG, deterministic_kernels, repeatable_setup


def _nudged(t: torch.Tensor, index: int) -> torch.Tensor:
    """``t`` with element ``index`` one ulp up."""
    out = t.clone()
    flat = out.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=t.dtype))
    return out


def test_one_ulp_in_any_element_changes_the_digest():
    torch.manual_seed(0)
    weights = {"a": torch.randn(3000, 700), "b": torch.randn(5)}
    before = params_digest(weights.items())
    for name, index in (("a", 0), ("a", 1_234_567), ("a", 3000 * 700 - 1), ("b", 4)):
        changed = {**weights, name: _nudged(weights[name], index)}
        assert params_digest(changed.items()) != before, (name, index)
    # two changes that cancel in a plain sum of the bits (one ulp up, one down) do not cancel here
    up_down = weights["a"].clone().view(-1)
    up_down[10] = torch.nextafter(up_down[10], torch.tensor(float("inf")))
    up_down[11] = torch.nextafter(up_down[11], torch.tensor(float("-inf")))
    assert params_digest({**weights, "a": up_down.view(3000, 700)}.items()) != before
    # the names, the order, the shapes count too
    assert params_digest([("b", weights["b"]), ("a", weights["a"])]) != before
    assert params_digest([("a", weights["a"].view(700, 3000)), ("b", weights["b"])]) != before
    assert params_digest(weights.items()) == before


def test_the_digest_does_not_depend_on_threads_or_how_a_tensor_is_cut(monkeypatch):
    """Integer sums: the same whatever the reduction's order (torch's threads) and however many passes the tensor
    takes (``CHUNK``), where a float sum would not be."""
    torch.manual_seed(1)
    t = torch.randn(5 * digest.BLOCK + 17)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_sums(t)
        torch.set_num_threads(2)
        two = tensor_sums(t)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(digest, "CHUNK", 2 * digest.BLOCK)
    assert one == two == tensor_sums(t)
    assert tensor_sums(torch.zeros(0)) == [0] * digest.WEIGHTINGS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_dtype_a_policy_trains_in_is_read_bit_by_bit(dtype):
    t = torch.linspace(-1, 1, 999, dtype=dtype)
    assert params_digest([("w", _nudged(t, 500))]) != params_digest([("w", t)])


def test_the_trainer_digests_only_what_it_trains(random_checkpoints):
    """Full fine-tuning: every parameter; LoRA: the adapters (the base stays as loaded)."""
    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    a, _ = random_checkpoints
    full = PolicyTrainer(a, update_settings(micro_batch_size=2))
    lora = PolicyTrainer(a, update_settings(micro_batch_size=2, lora_rank=2, lora_alpha=4.0))
    named = dict(full.model.named_parameters())
    before = full.params_digest()
    assert before == params_digest(named.items())
    adapters = [(n, p) for n, p in lora.model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, _ in adapters)
    assert lora.params_digest() == params_digest(adapters)
    with torch.no_grad():
        next(iter(named.values())).view(-1)[0] += 1e-3
    assert full.params_digest() != before


def test_deterministic_kernels_collect_the_operations_without_one_and_put_torch_back():
    from torch._prims_common import alert_not_deterministic  # what torch's own operations call

    assert not torch.are_deterministic_algorithms_enabled()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with deterministic_kernels(True) as found:
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.utils.deterministic.fill_uninitialized_memory  # a cost that repeats nothing
            alert_not_deterministic("scatter_reduce_cuda")
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert len(found) == 1 and found[0].startswith("scatter_reduce_cuda does not have a deterministic implementation")
    assert [str(w.message) for w in shown] == ["something else"]  # other warnings are shown as before
    assert not torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    with deterministic_kernels(False) as found:
        assert not torch.are_deterministic_algorithms_enabled()
    assert found == []


def test_the_repeatable_setup_fixes_cublas_workspace_unless_the_user_set_another(monkeypatch):
    monkeypatch.setenv(CUBLAS_CONFIG, "recorded")  # so that the test's own setting is undone after it
    monkeypatch.delenv(CUBLAS_CONFIG)
    assert repeatable_setup(cuda=False) is None and CUBLAS_CONFIG not in os.environ
    assert repeatable_setup(cuda=True) is None
    assert os.environ[CUBLAS_CONFIG] == ":4096:8"
    monkeypatch.setenv(CUBLAS_CONFIG, ":0:0")
    reason = repeatable_setup(cuda=True)
    assert reason == "CUBLAS_WORKSPACE_CONFIG=:0:0 (cuBLAS repeats its results only with :4096:8 or :16:8)"
