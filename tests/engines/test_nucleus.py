"""The sort-free top-p: the same nucleus as vLLM's own top-p, and the processor's per-row bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (the lent GPU machine's image has none)")

from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor.interface import MoveDirectionality
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from coba_tasks.engines.rollout.nucleus import (
    EXTRA_KEY,
    NucleusLogitsProcessor,
    mask_outside_nucleus,
    request_top_p,
)


def vllm_nucleus(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return apply_top_k_top_p_pytorch(logits.clone(), None, p, allow_cpu_sync=True)


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.3])  # peaked (nucleus among the top 256), mixed, flat (the sort)
def test_the_nucleus_is_vllms_on_peaked_and_flat_rows(scale):
    torch.manual_seed(0)
    logits = torch.randn(64, 4096) * scale
    p = torch.rand(64) * 0.98 + 0.01
    p[:4] = torch.tensor([0.9, 0.5, 0.999, 1e-3])
    want = vllm_nucleus(logits, p)
    got = mask_outside_nucleus(logits.clone(), p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])  # kept logits unchanged
    kept = torch.isfinite(got).sum(dim=1)
    assert kept.min() >= 1 and kept.max() < 4096
    if scale == 8.0:
        assert kept.max() <= 256  # every row took the sort-free path
    if scale == 0.3:
        assert bool((kept[p >= 0.5] > 256).all())  # those rows needed the full sort


def test_the_whole_vocabulary_smaller_than_the_search():
    torch.manual_seed(1)
    logits = torch.randn(5, 40)
    p = torch.full((5,), 0.9)
    assert torch.equal(torch.isfinite(mask_outside_nucleus(logits.clone(), p)), torch.isfinite(vllm_nucleus(logits, p)))


def request(p: float | None) -> SimpleNamespace:
    return SimpleNamespace(extra_args=None if p is None else {EXTRA_KEY: p})


def test_processor_follows_requests_added_removed_and_moved():
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    proc = NucleusLogitsProcessor(config, torch.device("cpu"), False)
    assert proc.is_argmax_invariant()
    proc.update_state(
        BatchUpdate(
            batch_size=3,
            removed=[],
            added=[(0, request(0.5), [], []), (1, request(None), [], []), (2, request(0.9), [], [])],
            moved=[],
        )
    )
    assert proc.top_p[:3].tolist() == pytest.approx([0.5, 1.0, 0.9])
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert proc.top_p[:3].tolist() == pytest.approx([0.9, 1.0, 0.5])
    proc.update_state(
        BatchUpdate(batch_size=2, removed=[1], added=[], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])
    )
    assert proc.top_p[:3].tolist() == pytest.approx([0.9, 0.5, 1.0])
    proc.update_state(None)  # nothing changed
    torch.manual_seed(2)
    logits = torch.randn(2, 300) * 6
    out = proc.apply(logits.clone())
    for row, p in ((0, 0.9), (1, 0.5)):
        want = vllm_nucleus(logits[row : row + 1], torch.tensor([p]))
        assert torch.equal(torch.isfinite(out[row : row + 1]), torch.isfinite(want))
    proc.update_state(BatchUpdate(batch_size=2, removed=[0, 1], added=[], moved=[]))
    assert torch.equal(proc.apply(logits.clone()), logits)  # no row asks for a nucleus: untouched


@pytest.mark.parametrize("bad", [0.0, 1.5, "0.9", True])
def test_a_bad_top_p_is_refused(bad):
    with pytest.raises(ValueError, match=EXTRA_KEY):
        request_top_p({EXTRA_KEY: bad})
    assert request_top_p(None) == 1.0 and request_top_p({EXTRA_KEY: 0.9}) == 0.9
