"""GRPO math: ragged-group advantages, clip-higher token-mean loss, KL."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coba_tasks.core.grpo import (
    effective_prompts,
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
    prompt_loss_weights,
    rollout_correction_stats,
    rollout_correction_weights,
    token_logprobs,
    zero_variance_share,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These small tensors are fastest on one thread; the count is restored for the modules after this one
    (it was set at import: every test collected with this module ran its torch code on one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def group_advantages_loop(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Reference for ``group_advantages``: a plain Python loop over groups."""
    out = torch.zeros(rewards.shape, dtype=torch.float64, device=rewards.device)
    for gid in group_ids.unique().tolist():
        idx = (group_ids == gid).nonzero(as_tuple=True)[0]
        r = rewards[idx].to(torch.float64)
        if r.numel() < 2:
            raise ValueError(f"group id(s) [{gid}] have a single rollout; GRPO needs at least 2 per group")
        if bool((r == r[0]).all()):
            continue  # all equal: advantage 0
        out[idx] = (r - r.mean()) / (r.std() + eps)
    return out.to(rewards.dtype if rewards.dtype.is_floating_point else torch.get_default_dtype())


def ragged_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random groups of sizes 2..12 with shuffled, non-contiguous ids; some all-equal groups."""
    g = torch.Generator().manual_seed(seed)
    n_groups = int(torch.randint(1, 12, (1,), generator=g))
    ids = torch.randperm(1000, generator=g)[:n_groups] * 7 - 300  # negative and large ids too
    rewards, group_ids = [], []
    for gid in ids.tolist():
        size = int(torch.randint(2, 13, (1,), generator=g))
        kind = int(torch.randint(0, 3, (1,), generator=g))
        if kind == 0:  # binary verifier rewards, possibly all equal
            r = torch.randint(0, 2, (size,), generator=g).double()
        elif kind == 1:  # continuous
            r = torch.randn(size, generator=g, dtype=torch.float64) * 3 + 1
        else:  # all equal, a value that is not exact in binary
            r = torch.full((size,), 0.1, dtype=torch.float64)
        rewards.append(r)
        group_ids.append(torch.full((size,), gid, dtype=torch.int64))
    perm = torch.randperm(sum(len(r) for r in rewards), generator=g)
    return torch.cat(rewards)[perm], torch.cat(group_ids)[perm]


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def test_advantages_by_hand():
    # group 7: [1, 0, 1]: mean 2/3, sample std sqrt(1/3); group 3: [0, 1]: mean 1/2, std sqrt(1/2)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    g = torch.tensor([7, 7, 3, 7, 3])
    s7, s3 = math.sqrt(1 / 3) + 1e-6, math.sqrt(1 / 2) + 1e-6
    expected = [(1 / 3) / s7, (-2 / 3) / s7, -0.5 / s3, (1 / 3) / s7, 0.5 / s3]
    torch.testing.assert_close(group_advantages(r, g), torch.tensor(expected, dtype=torch.float64))


def test_advantages_use_sample_std():
    # {0, 1}: sample std 0.7071 -> +/- 0.7071 (population std 0.5 would give +/- 1)
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([0, 0]))
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0], dtype=torch.float64) * 0.5 / (math.sqrt(0.5) + 1e-6))


@pytest.mark.parametrize("seed", range(300))
def test_vectorised_matches_loop(seed):
    r, g = ragged_batch(seed)
    torch.testing.assert_close(group_advantages(r, g), group_advantages_loop(r, g), rtol=1e-12, atol=1e-12)


@given(
    sizes=st.lists(st.integers(2, 9), min_size=1, max_size=8),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_advantages_normalised_per_group(sizes, data):
    """Each non-constant group has advantage mean 0 and sample std ~1 (std_i >> eps here)."""
    rewards = [data.draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0]), min_size=n, max_size=n)) for n in sizes]
    r = torch.tensor([x for grp in rewards for x in grp], dtype=torch.float64)
    g = torch.tensor([i * 11 for i, n in enumerate(sizes) for _ in range(n)])
    adv = group_advantages(r, g)
    torch.testing.assert_close(adv, group_advantages_loop(r, g), rtol=1e-12, atol=1e-12)
    for i, grp in enumerate(rewards):
        a = adv[g == i * 11]
        if len(set(grp)) == 1:
            assert torch.equal(a, torch.zeros_like(a))
        else:
            assert abs(float(a.mean())) < 1e-9
            assert float(a.std()) == pytest.approx(1.0, rel=1e-4)


def test_advantages_invariant_to_order_and_id_labels():
    r, g = ragged_batch(42)
    adv = group_advantages(r, g)
    perm = torch.randperm(r.numel(), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(group_advantages(r[perm], g[perm]), adv[perm])
    relabelled = g * -3 + 10_000_000  # a different injective labelling of the same groups
    torch.testing.assert_close(group_advantages(r, relabelled), adv)


def test_all_equal_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must not depend on rounding
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.7, 0.7], dtype=torch.float32)
    g = torch.tensor([4, 4, 4, 9, 9, 2, 2])
    adv = group_advantages(r, g)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[[0, 1, 2, 5, 6]], torch.zeros(5))
    assert torch.all(adv[3:5] != 0)


def test_size_one_group_raises_naming_the_id():
    r = torch.tensor([1.0, 0.0, 1.0])
    g = torch.tensor([5, 5, 123])
    with pytest.raises(ValueError, match=r"\[123\]"):
        group_advantages(r, g)


def test_advantages_input_checks():
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="same length"):
        group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.int64))
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64)).shape == (0,)


def test_integer_rewards_give_float_advantages():
    adv = group_advantages(torch.tensor([1, 0, 0, 0]), torch.tensor([1, 1, 1, 1]))
    assert adv.dtype == torch.get_default_dtype()
    assert float(adv[0]) == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-6)  # mean 1/4, sample std 1/2


def test_zero_variance_share():
    r = torch.tensor([1, 1, 0, 1, 0, 0, 2, 2, 2])
    g = torch.tensor([5, 5, 2, 2, 8, 8, 0, 0, 0])
    assert zero_variance_share(r, g) == pytest.approx(3 / 4)  # groups 5, 8, 0 constant; 2 mixed
    assert zero_variance_share(torch.zeros(0), torch.zeros(0, dtype=torch.int64)) == 0.0


# ---------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------


def _logps_from_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_old fixed, logp_new = logp_old + log(ratio) (float64)."""
    logp_old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.7, -2.2]], dtype=torch.float64)
    logp_new = (logp_old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_()
    return logp_new, logp_old


def test_loss_by_hand():
    # 2 sequences x 3 tokens; the last token of sequence 0 is padding (ratio 10 there must not count).
    ratios = [[1.5, 0.9, 10.0], [0.5, 1.1, 1.0]]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    logp_new, logp_old = _logps_from_ratios(ratios)
    # per token: max(-A * rho, -A * clip(rho, 0.8, 1.28))
    # seq 0, A = +1: rho 1.5 -> max(-1.5, -1.28) = -1.28 (clipped); rho 0.9 -> -0.9
    # seq 1, A = -2: rho 0.5 -> max(1.0, 1.6) = 1.6 (clipped); rho 1.1 -> 2.2; rho 1.0 -> 2.0
    tokens = [-1.28, -0.9, 1.6, 2.2, 2.0]
    expected = sum(tokens) / 5  # = 0.724
    loss, stats = policy_loss(logp_new, logp_old, adv, mask)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.724)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["n_tokens"] == 5
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.9 + 0.5 + 1.1 + 1.0) / 5)
    assert stats["ratio_max"] == pytest.approx(1.5)  # the masked 10.0 is ignored
    k3 = sum(r - 1 - math.log(r) for r in [1.5, 0.9, 0.5, 1.1, 1.0]) / 5
    k1 = sum(-math.log(r) for r in [1.5, 0.9, 0.5, 1.1, 1.0]) / 5
    assert stats["approx_kl"] == pytest.approx(k3)
    assert stats["approx_kl_k1"] == pytest.approx(k1)

    # gradient: d/d logp of -A * rho is -A * rho / n on unclipped tokens, 0 on clipped and masked ones
    loss.backward()
    expected_grad = [[0.0, -1.0 * 0.9 / 5, 0.0], [0.0, 2.0 * 1.1 / 5, 2.0 * 1.0 / 5]]
    torch.testing.assert_close(logp_new.grad, torch.tensor(expected_grad, dtype=torch.float64))


def test_ratio_one_gives_minus_mean_token_advantage():
    g = torch.Generator().manual_seed(0)
    logp_old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    lengths = [6, 2, 4, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    adv = torch.tensor([0.5, -1.0, 2.0, -0.25], dtype=torch.float64)
    loss, stats = policy_loss(logp_old.clone(), logp_old, adv, mask)
    expected = -sum(a * n for a, n in zip(adv.tolist(), lengths, strict=True)) / sum(lengths)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["clip_frac"] == 0.0
    assert stats["approx_kl"] == 0.0
    assert stats["ratio_mean"] == 1.0 and stats["ratio_max"] == 1.0


def test_clip_higher_is_asymmetric():
    # one token per sequence; each row: (ratio, advantage, expected per-token loss, clipped?)
    cases = [
        (1.5, 1.0, -1.28, True),  # A > 0: capped at 1 + 0.28
        (1.25, 1.0, -1.25, False),  # beyond 1.2, inside 1.28: symmetric PPO would clip, clip-higher does not
        (0.5, -1.0, 0.8, True),  # A < 0: floored at 1 - 0.2
        (0.85, -1.0, 0.85, False),
        (1.5, -1.0, 1.5, False),  # A < 0 and rho high: the unclipped branch is the pessimistic one
        (0.5, 1.0, -0.5, False),  # A > 0 and rho low: likewise
    ]
    for ratio, a, expected, clipped in cases:
        logp_old = torch.tensor([[-1.2]], dtype=torch.float64)
        logp_new = (logp_old + math.log(ratio)).requires_grad_()
        loss, stats = policy_loss(logp_new, logp_old, torch.tensor([a], dtype=torch.float64), torch.ones(1, 1))
        assert loss.item() == pytest.approx(expected), (ratio, a)
        assert stats["clip_frac"] == (1.0 if clipped else 0.0), (ratio, a)
        loss.backward()
        grad = float(logp_new.grad)
        assert grad == (0.0 if clipped else pytest.approx(-a * ratio)), (ratio, a)


def test_custom_clip_range():
    logp_old = torch.zeros(1, 1, dtype=torch.float64)
    loss, _ = policy_loss(
        logp_old + math.log(1.5), logp_old, torch.ones(1, dtype=torch.float64), torch.ones(1, 1), 0.2, 0.2
    )
    assert loss.item() == pytest.approx(-1.2)


def _random_problem(seed: int, b: int = 6, t: int = 7, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, v, (b, t), generator=g)
    lengths = torch.tensor([7, 1, 4, 6, 2, 5])[:b]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    logp_old = token_logprobs(logits, tokens) + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logits, tokens, mask, logp_old, adv


def test_micro_batches_sum_to_full_batch_loss_and_gradient():
    logits, tokens, mask, logp_old, adv = _random_problem(0)

    full_logits = logits.clone().requires_grad_()
    full, full_stats = policy_loss(token_logprobs(full_logits, tokens), logp_old, adv, mask)
    full.backward()
    assert 0 < full_stats["clip_frac"] < 1  # the example exercises both branches

    micro_logits = logits.clone().requires_grad_()
    n_tokens = mask.sum()
    total = 0.0
    for idx in (slice(0, 2), slice(2, 5), slice(5, 6)):  # uneven micro-batches, uneven token counts
        part, _ = policy_loss(
            token_logprobs(micro_logits[idx], tokens[idx]), logp_old[idx], adv[idx], mask[idx], token_count=n_tokens
        )
        part.backward()  # gradients accumulate into micro_logits.grad
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(micro_logits.grad, full_logits.grad, rtol=1e-10, atol=1e-12)

    # without the whole-batch count, each micro-batch is normalised by its own tokens: not equal
    naive = sum(
        float(policy_loss(token_logprobs(logits[i], tokens[i]), logp_old[i], adv[i], mask[i])[0]) / 3
        for i in (slice(0, 2), slice(2, 5), slice(5, 6))
    )
    assert naive != pytest.approx(full.item(), abs=1e-6)


def test_gradient_flows_only_through_logp_new():
    logits, tokens, mask, logp_old, adv = _random_problem(1)
    logp_new = token_logprobs(logits, tokens).requires_grad_()
    logp_old = logp_old.clone().requires_grad_()
    adv = adv.clone().requires_grad_()
    loss, _ = policy_loss(logp_new, logp_old, adv, mask)
    loss.backward()
    assert logp_old.grad is None
    assert adv.grad is None
    assert logp_new.grad is not None and logp_new.grad.abs().sum() > 0
    assert torch.all(logp_new.grad[mask == 0] == 0)  # padding gets no gradient


def test_masked_padding_values_do_not_leak():
    # -inf log-probs on padding (a common fill value) must not turn the loss into NaN
    logp_old = torch.tensor([[-1.0, float("-inf")]], dtype=torch.float64)
    logp_new = torch.tensor([[-1.0, float("-inf")]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp_new, logp_old, torch.tensor([2.0], dtype=torch.float64), torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert torch.isfinite(logp_new.grad).all()


def test_empty_mask_and_bad_inputs():
    z = torch.zeros(2, 3)
    loss, stats = policy_loss(z.clone().requires_grad_(), z, torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0 and stats["n_tokens"] == 0 and math.isnan(stats["clip_frac"])
    with pytest.raises(ValueError, match=r"\(B,\)"):
        policy_loss(z, z, torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        policy_loss(z, torch.zeros(2, 4), torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(z, z, torch.ones(2), torch.ones(2, 3), clip_low=1.0)
    with pytest.raises(ValueError, match="count"):
        policy_loss(z, z, torch.ones(2), torch.ones(2, 3), token_count=0)


# ---------------------------------------------------------------------------------------------
# Token-level helpers and KL
# ---------------------------------------------------------------------------------------------


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert float(masked_mean(x, mask)) == pytest.approx((1 + 2 + 5 + 6) / 4)
    assert float(masked_mean(x, mask, count=10)) == pytest.approx(14 / 10)
    assert float(masked_mean(x, torch.zeros(2, 3))) == 0.0


def test_token_logprobs_matches_manual():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    out = token_logprobs(logits, tokens)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].tolist()
            expected = row[int(tokens[b, t])] - math.log(sum(math.exp(x) for x in row))
            assert float(out[b, t]) == pytest.approx(expected, abs=1e-12)
    half = token_logprobs(logits.to(torch.bfloat16), tokens)
    assert half.dtype == torch.float32  # low-precision logits are upcast


def test_entropy():
    v = 17
    uniform = entropy_from_logits(torch.full((2, 3, v), 0.7))
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(v)))
    peaked = torch.full((1, 1, v), -1e4)
    peaked[0, 0, 3] = 0.0
    assert float(entropy_from_logits(peaked)) == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(1, 1, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    p = torch.softmax(logits[0, 0], -1).tolist()
    assert float(entropy_from_logits(logits)) == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-12)


def test_kl_estimators():
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(logp, logp.clone(), mask, kind), torch.zeros(3, 4, dtype=torch.float64))

    ref = logp + 0.5 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    d = (ref - logp)[0, 0].item()  # log(ref / pi)
    assert float(kl_penalty(logp, ref, mask, "k1")[0, 0]) == pytest.approx(-d)
    assert float(kl_penalty(logp, ref, mask, "k2")[0, 0]) == pytest.approx(0.5 * d * d)
    k3 = kl_penalty(logp, ref, mask, "k3")
    assert float(k3[0, 0]) == pytest.approx(math.exp(d) - 1 - d)
    assert torch.all(k3 >= 0) and torch.all(k3[mask == 0] == 0)

    # gradient through logp only
    lp = logp.clone().requires_grad_()
    rf = ref.clone().requires_grad_()
    masked_mean(kl_penalty(lp, rf, mask, "k3"), mask).backward()
    assert rf.grad is None and lp.grad.abs().sum() > 0

    with pytest.raises(ValueError, match=r"k1.*k2.*k3"):
        kl_penalty(logp, ref, mask, "k9")


# ---------------------------------------------------------------------------------------------
# Rollout correction (truncated importance sampling)
# ---------------------------------------------------------------------------------------------


def test_rollout_correction_weights_token_sequence_cap_and_mask():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    samp = old - torch.tensor([[math.log(3.0), math.log(0.5), 9.0], [math.log(1.5), 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w, r, d = rollout_correction_weights(old, samp, mask, "token", cap=2.0)
    assert r.flatten().tolist() == pytest.approx(
        list(itertools.chain.from_iterable([[3.0, 0.5, 1.0], [1.5, 1.0, 1.0]]))
    )  # 1 off the mask
    assert w.flatten().tolist() == pytest.approx(
        list(itertools.chain.from_iterable([[2.0, 0.5, 0.0], [1.5, 0.0, 0.0]]))
    )  # min(ratio, C), 0 off the mask
    assert not d.any()
    w, r, d = rollout_correction_weights(old, samp, mask, "sequence", cap=2.0)
    assert r.flatten().tolist() == pytest.approx(
        list(itertools.chain.from_iterable([[1.5, 1.5, 1.0], [1.5, 1.0, 1.0]]))
    )  # 3 * 0.5 on each token of row 0
    assert w.flatten().tolist() == pytest.approx(
        list(itertools.chain.from_iterable([[1.5, 1.5, 0.0], [1.5, 0.0, 0.0]]))
    )
    # tau = 2.5: ratios outside [0.4, 2.5] are dropped (3.0 at token level), not truncated
    w, r, d = rollout_correction_weights(old, samp, mask, "token", cap=2.0, mask_threshold=2.5)
    assert d.tolist() == [[True, False, False], [False, False, False]]
    assert w.flatten().tolist() == pytest.approx(
        list(itertools.chain.from_iterable([[0.0, 0.5, 0.0], [1.5, 0.0, 0.0]]))
    )
    st_ = rollout_correction_stats(r, d, mask, cap=2.0)
    assert st_["is_ratio_mean"] == pytest.approx(5.0 / 3) and st_["is_ratio_max"] == pytest.approx(3.0)
    assert st_["is_clipped_frac"] == 0.0 and st_["is_masked_frac"] == pytest.approx(1 / 3)
    w, r, d = rollout_correction_weights(old, samp, mask, "sequence", cap=2.0, mask_threshold=1.2)
    assert d.tolist() == [[True, True, False], [True, False, False]] and not w.any()
    none = rollout_correction_stats(r, d, mask, cap=None)  # not applied: nothing clipped or masked
    assert none["is_clipped_frac"] == 0.0 and none["is_masked_frac"] == 0.0
    for bad in ({"level": "none"}, {"cap": 0.0}, {"mask_threshold": 1.0}, {"level": "tokens"}):
        with pytest.raises(ValueError):
            rollout_correction_weights(old, samp, mask, **({"level": "token"} | bad))


def test_rollout_correction_weight_none_and_one_leave_the_loss_bit_identical():
    g = torch.Generator().manual_seed(0)
    new = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    old = new.detach() + 0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    grads = []
    for kwargs in ({}, {"weights": None}, {"weights": rollout_correction_weights(old, old, mask, "token")[0]}):
        loss, _ = policy_loss(new, old, adv, mask, token_count=9.0, **kwargs)
        (g_,) = torch.autograd.grad(loss, new)
        grads.append((loss.detach(), g_))
    assert all(torch.equal(grads[0][0], x) and torch.equal(grads[0][1], y) for x, y in grads[1:])
    # a row with advantage 0 contributes exactly nothing, whatever its weight
    heavy = torch.full((3, 4), 2.0, dtype=torch.float64)
    loss, _ = policy_loss(new, old, adv, mask, token_count=9.0, weights=heavy)
    (g_,) = torch.autograd.grad(loss, new)
    assert torch.all(g_[1] == 0)


def _enumerated_batch(q1, q2, n):
    """Every pair (a, b) of a 2-token completion, repeated n * q1[a] * q2[b] times: the exact expectation
    under the sampler q = q1 x q2 as a batch."""
    rows = []
    for a, qa in enumerate(q1):
        for b, qb in enumerate(q2):
            rows += [(a, b)] * round(n * qa * qb)
    assert len(rows) == n
    return torch.tensor(rows)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_corrected_gradient_is_the_on_policy_gradient(level):
    """Tokens sampled from q (the sampler), trained with p (the trainer's policy, softmax of theta per position).

    The on-policy policy gradient is g* = sum_x p(x) A(x) grad log p(x). The sampled batch (an exact
    enumeration of q) with weights w = p/q gives it exactly: for a single token (token level), and for a
    sequence with one advantage when the weight is the sequence's ratio (sequence level). Without the weight
    it is q's expectation, which differs."""
    q1, q2 = [0.125, 0.25, 0.625], [0.5, 0.25, 0.25]  # the sampler: exact binary fractions, n = 32 rows
    theta = torch.tensor([[0.3, -0.2, 0.5], [-0.4, 0.1, 0.6]], dtype=torch.float64, requires_grad=True)
    logq = torch.log(torch.tensor([q1, q2], dtype=torch.float64))
    xs = _enumerated_batch(q1, q2, 32)  # (32, 2)
    reward = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0], [2.0, 0.0, -0.5]], dtype=torch.float64)
    cols = torch.arange(2)
    if level == "token":
        xs = xs[:, :1]  # one token per completion: position 0 only
        cols = cols[:1]

    def adv_of(x):  # a sequence-level advantage, any function of the completion
        return reward[x[:, 0], x[:, 1]] if x.shape[1] == 2 else reward[x[:, 0], 0]

    def logp_of(th, x):  # (B, T) log p of each token
        return torch.log_softmax(th, dim=-1)[cols, x]

    # exact on-policy gradient: enumerate p
    vocab = range(3)
    completions = torch.tensor(list(itertools.product(vocab, repeat=len(cols))))
    lp = logp_of(theta, completions).sum(-1)  # (K,) log p(x)
    objective = (lp.detach().exp() * adv_of(completions) * lp).sum()  # grad = sum p A grad log p
    (g_star,) = torch.autograd.grad(objective, theta)

    logp = logp_of(theta, xs)  # (32, T) with gradient; first step: logp_old = logp
    old = logp.detach()
    samp = logq[cols, xs]
    mask = torch.ones_like(old)
    adv = adv_of(xs)
    per_seq_tokens = float(len(cols))

    def gradient(weights):
        loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, weights=weights)
        (g,) = torch.autograd.grad(loss, theta, retain_graph=True)
        return -g * per_seq_tokens  # loss = -(1/(n T)) sum A w rho: undo the token mean and the sign

    w, ratio, _ = rollout_correction_weights(old, samp, mask, level, cap=1e6)
    corrected, plain = gradient(w), gradient(None)
    assert torch.allclose(corrected, g_star, rtol=1e-10, atol=1e-12)
    assert float((plain - g_star).norm()) > 0.1 * float(g_star.norm())  # the uncorrected gradient is q's
    # a cap below the largest ratio truncates: the weight is min(ratio, C), no longer unbiased
    cap = float(ratio.max()) * 0.5
    w_cap, _, _ = rollout_correction_weights(old, samp, mask, level, cap=cap)
    assert torch.equal(w_cap, ratio.clamp(max=cap))
    assert not torch.allclose(gradient(w_cap), g_star, rtol=1e-6)


def test_token_level_weights_are_biased_for_a_sequence_advantage():
    """With a completion of two tokens, the per-token ratio corrects each token's marginal only: its gradient
    differs from the on-policy one, which the sequence-level ratio recovers (the test above)."""
    q1, q2 = [0.125, 0.25, 0.625], [0.5, 0.25, 0.25]
    theta = torch.tensor([[0.3, -0.2, 0.5], [-0.4, 0.1, 0.6]], dtype=torch.float64, requires_grad=True)
    logq = torch.log(torch.tensor([q1, q2], dtype=torch.float64))
    xs = _enumerated_batch(q1, q2, 32)
    reward = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0], [2.0, 0.0, -0.5]], dtype=torch.float64)
    cols = torch.arange(2)
    logp = torch.log_softmax(theta, dim=-1)[cols, xs]
    old, samp, mask, adv = logp.detach(), logq[cols, xs], torch.ones(32, 2), reward[xs[:, 0], xs[:, 1]]
    grads = {}
    for level in ("token", "sequence"):
        w, _, _ = rollout_correction_weights(old, samp, mask, level, cap=1e6)
        loss, _ = policy_loss(logp, old, adv, mask, weights=w)
        (grads[level],) = torch.autograd.grad(loss, theta, retain_graph=True)
    assert not torch.allclose(grads["token"], grads["sequence"], rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# Prompt weighting
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.integers(0, 5), min_size=1, max_size=14),
    data=st.data(),
)
def test_equal_prompt_weights_give_each_prompt_the_same_weight(groups, data):
    """Ragged, unsorted groups, completions of 0 to 6 tokens: the loss sum_r c_r sum_t L_rt / sum_r c_r T_r with
    the equal weights is (1/M) sum_i (1/T_i) sum_{t in i} L_t, M the groups with a token, in float64 within
    1e-12; through ``policy_loss`` (weights c_r, token_count sum_r c_r T_r) as well. Under tokens every weight
    is 1. sum_r c_r T_r is the batch's token count."""
    n = len(groups)
    lengths = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    g = torch.tensor(groups)
    t = torch.tensor(lengths)
    width = max([*lengths, 1])
    mask = torch.arange(width).unsqueeze(0) < t.unsqueeze(1)  # (n, W)
    gen = torch.Generator().manual_seed(len(groups) * 7 + sum(lengths))
    loss_t = torch.randn(n, width, generator=gen, dtype=torch.float64)  # the per-token losses L_rt
    assert torch.equal(prompt_loss_weights(g, t, "tokens"), torch.ones(n, dtype=torch.float64))
    c = prompt_loss_weights(g, t, "equal")
    if sum(lengths) == 0:
        assert torch.equal(c, torch.zeros(n, dtype=torch.float64))
        return
    assert float((c * t).sum()) == pytest.approx(sum(lengths), rel=1e-12)
    per_group = {}  # written out: each group's token mean, then the mean over the groups with a token
    for r, gid in enumerate(groups):
        tok, total = per_group.get(gid, (0, 0.0))
        per_group[gid] = (tok + lengths[r], total + math.fsum(loss_t[r, : lengths[r]].tolist()))
    want = sum(total / tok for tok, total in per_group.values() if tok) / sum(1 for tok, _ in per_group.values() if tok)
    weighted = float(torch.where(mask, loss_t, 0.0).sum(-1).mul(c).sum() / (c * t).sum())
    assert weighted == pytest.approx(want, rel=1e-12, abs=1e-12)
    # through policy_loss at rho = 1: L_rt = -A_r, so the loss is -(1/M) sum_i (1/T_i) sum_{r in i} A_r T_r
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    logp = torch.randn(n, width, generator=gen, dtype=torch.float64)
    got, _ = policy_loss(logp, logp, adv, mask, token_count=float((c * t).sum()), weights=c.unsqueeze(-1) * mask)
    per_group = {}
    for r, gid in enumerate(groups):
        tok, total = per_group.get(gid, (0, 0.0))
        per_group[gid] = (tok + lengths[r], total - float(adv[r]) * lengths[r])
    want = sum(total / tok for tok, total in per_group.values() if tok) / sum(1 for tok, _ in per_group.values() if tok)
    assert float(got) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_equal_prompt_weights_edges():
    """Every group with as many tokens: every weight is exactly 1 (the token mean, bit for bit). A group without
    a completion token weighs nothing and is not counted in M. Shapes and names are checked."""
    even = prompt_loss_weights(torch.tensor([3, 3, 1, 1, 1, 8]), torch.tensor([4, 2, 1, 2, 3, 6]), "equal")
    assert torch.equal(even, torch.ones(6, dtype=torch.float64))
    c = prompt_loss_weights(torch.tensor([0, 0, 1, 2]), torch.tensor([2, 2, 0, 1]), "equal")
    assert c.tolist() == [5 / (2 * 4), 5 / (2 * 4), 0.0, 5 / (2 * 1)]
    with pytest.raises(ValueError, match="'prompts' is not a valid PromptWeighting"):
        prompt_loss_weights(torch.tensor([0]), torch.tensor([1]), "prompts")
    with pytest.raises(ValueError, match="1-D of the same length"):
        prompt_loss_weights(torch.tensor([0, 1]), torch.tensor([1]), "equal")
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        prompt_loss_weights(torch.tensor([0, 1]), torch.tensor([1, -1]), "equal")
    assert prompt_loss_weights(torch.zeros(0, dtype=torch.long), torch.zeros(0), "equal").numel() == 0


def test_effective_prompts_counts_the_prompts_with_a_gradient():
    """Under tokens (sum T_i)^2 / sum T_i^2 over the prompts with a non-zero advantage; under equal their number;
    an all-equal group (advantage 0 everywhere) is left out, a group with one 0 among others is not; 0.0
    without any. 3 prompts of 30 rollouts and 29 of 2 (one length): 148^2 / (3 * 30^2 + 29 * 2^2)."""
    g = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    t = torch.tensor([3, 1, 2, 5, 5, 1, 1, 1, 1])
    adv = torch.tensor([0.5, 0.0, -0.5, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0])
    tokens = effective_prompts(g, t, prompt_loss_weights(g, t, "tokens"), adv)
    assert tokens == pytest.approx((6 + 4) ** 2 / (6**2 + 4**2), rel=1e-15)
    assert effective_prompts(g, t, prompt_loss_weights(g, t, "equal"), adv) == pytest.approx(2.0, rel=1e-15)
    assert effective_prompts(g, t, torch.ones(9), torch.zeros(9)) == 0.0
    sizes = torch.tensor([30] * 3 + [2] * 29)
    big = torch.repeat_interleave(torch.arange(32), sizes)
    ones = torch.ones(big.numel())
    assert effective_prompts(big, ones, ones, ones) == pytest.approx(148**2 / (3 * 900 + 29 * 4), rel=1e-15)
    assert effective_prompts(big, ones, prompt_loss_weights(big, ones, "equal"), ones) == pytest.approx(32, rel=1e-14)
    with pytest.raises(ValueError, match="1-D of one length"):
        effective_prompts(g, t, torch.ones(8), adv)
