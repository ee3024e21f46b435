"""optim.prompt_weighting in the update: ``tokens`` (the token mean) and ``equal`` (each prompt's group weighs
the same). The trainer's gradient of every optimizer step is compared with the loss written out directly, row
by row, on the tiny model in float64, at a learning rate of 0 (every step's gradient is then taken at the
starting weights, where the ratio is 1).

The written-out loss runs each row alone as a full ``prompt + completion`` sequence. The full-sequence update
agrees with it within 1e-10 relative (measured: 1e-16); the shared-prefix update within 1e-6 (measured: 4e-8
under tokens as under equal: its gradient differs from the full sequences' by that much in float64 whatever
the weighting), far below the 1e-3 by which the two weightings' gradients differ here."""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pytest
import torch

from coba_tasks.core.grpo import PromptWeighting
from coba_tasks.engines import update as update_module
from coba_tasks.engines.update import DataShard, PolicyTrainer, PromptWeights, UpdateSettings, pad_sequences
from coba_tasks.pipeline.config_sections import PromptWeightingName
from coba_tasks.pipeline.policy import update_settings

P0, P1, P2, P3 = [10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 12]
# (group, prompt, completion, advantage), rows interleaved: group 1's rewards are all equal (advantage 0), group
# 2 has a rollout at its mean (advantage 0), group 3 has the same prompt tokens as group 0 but is another
# prompt of the batch; the groups have 3, 2, 4, 2 and 5 rollouts and 6, 4, 9, 3 and 29 completion tokens
ROWS = [
    (0, P0, [20, 21, 2], 1.2),
    (4, P3, [40, 41, 42, 43, 44, 2], 0.9),
    (1, P1, [30, 2], 0.0),
    (2, P2, [50, 51, 52, 2], 1.0),
    (0, P0, [22, 2], -0.6),
    (3, P0, [23], 0.7),
    (4, P3, [45, 46, 47, 48, 2], -0.4),
    (2, P2, [53], 0.0),
    (1, P1, [31, 2], 0.0),
    (4, P3, [49, 50, 51, 52, 53, 54, 2], -1.1),
    (0, P0, [24], -0.6),
    (2, P2, [55, 2], -1.0),
    (3, P0, [25, 2], -0.7),
    (4, P3, [56, 57, 58, 59, 55, 2], 0.3),
    (2, P2, [33, 2], 0.0),
    (4, P3, [60, 61, 62, 63, 2], 0.3),
]
GROUPS = np.array([r[0] for r in ROWS])
PROMPTS = [r[1] for r in ROWS]
COMPLETIONS = [r[2] for r in ROWS]
ADV = np.array([r[3] for r in ROWS], dtype=np.float32).astype(np.float64)  # the update takes float32 advantages
TOL = {False: 1e-10, True: 1e-6}  # relative gradient tolerance by shared_prefix (see above)
LR0 = {"lr": 0.0, "max_grad_norm": 1e9, "micro_batch_size": 2}  # no step moves the weights; no clipping


def reference_row_weights(weighting: str, groups=GROUPS, completions=COMPLETIONS) -> list[float]:
    """Each row's token weight, written out: 1 (tokens) or 1 / (M * T_i) (equal), by a loop over the groups."""
    if weighting == "tokens":
        return [1.0] * len(groups)
    tokens = {int(g): 0 for g in groups}
    for g, c in zip(groups, completions, strict=True):
        tokens[int(g)] += len(c)
    m = sum(1 for t in tokens.values() if t > 0)
    return [1.0 / (m * tokens[int(g)]) for g in groups]


def row_logprobs(model, trainer: PolicyTrainer, prompt, completion) -> torch.Tensor:
    """log p of one row's completion tokens, the row run alone through ``model`` (with gradients)."""
    ids, attn, comp = pad_sequences([prompt], [completion], trainer.pad_id)
    logp, _ = trainer._logprobs(model, ids, attn)
    return logp[0][comp[0, 1:].bool()]


def direct_loss(trainer: PolicyTrainer, rows, weighting: str, sampler=None, cap=2.0, kl_coef=0.0) -> torch.Tensor:
    """A mini-batch's loss from its definition, at rho = 1: sum_r c_r sum_t w_rt L_rt / sum_r c_r T_r over every
    row of the mini-batch, L_rt = -A_r * rho_rt, w_rt the token-level rollout correction min(pi / pi_samp, cap),
    plus kl_coef times the k3 KL to the reference weighted the same way."""
    c = reference_row_weights(weighting)
    num = torch.zeros((), dtype=torch.float64)
    for r in rows:
        logp = row_logprobs(trainer.model, trainer, PROMPTS[r], COMPLETIONS[r])
        per_token = -float(ADV[r]) * torch.exp(logp - logp.detach())
        if sampler is not None:
            per_token = per_token * torch.exp(logp.detach() - torch.tensor(sampler[r], dtype=torch.float64)).clamp(
                max=cap
            )
        if kl_coef:
            with torch.no_grad():
                ref = row_logprobs(trainer.ref_model, trainer, PROMPTS[r], COMPLETIONS[r])
            x = ref - logp
            per_token = per_token + kl_coef * (torch.expm1(x) - x)
        num = num + c[r] * per_token.sum()
    return num / sum(c[r] * len(COMPLETIONS[r]) for r in rows)


def captured_steps(trainer: PolicyTrainer) -> list[torch.Tensor]:
    """The whole gradient of each optimizer step (one flat float64 tensor each), filled in as the update runs."""
    steps: list[torch.Tensor] = []
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        steps.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad]).double())
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return steps


def direct_gradient(trainer: PolicyTrainer, rows, weighting, **kw) -> torch.Tensor:
    trainer.model.zero_grad(set_to_none=True)
    direct_loss(trainer, rows, weighting, **kw).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad]).double()


def float64_trainer(a, settings: UpdateSettings) -> PolicyTrainer:
    trainer = PolicyTrainer(a, settings)
    trainer.model.to(torch.float64)  # the optimizer holds the same parameters, now in float64
    if trainer.ref_model is not None:
        trainer.ref_model.to(torch.float64)
    return trainer


@pytest.fixture
def mini_batch_rows(monkeypatch) -> list[list[int]]:
    """The rows of each mini-batch of the updates that follow, in the order of their optimizer steps (every
    row of the mini-batch, those left out of the passes too: the update asks for each one's normaliser)."""
    seen: list[list[int]] = []
    tokens = PromptWeights.tokens

    def spy(self, rows):
        seen.append([int(r) for r in rows])
        return tokens(self, rows)

    monkeypatch.setattr(PromptWeights, "tokens", spy)
    return seen


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-10) -> None:
    assert float(want.norm()) > 0
    assert float((got - want).norm()) <= rel * float(want.norm()), float((got - want).norm() / want.norm())


# ---------------------------------------------------------------------------------------------
# The helper the update uses
# ---------------------------------------------------------------------------------------------


def test_the_config_words_are_the_weightings():
    assert set(get_args(PromptWeightingName)) == {k.value for k in PromptWeighting}
    assert update_settings().prompt_weighting == "tokens"
    with pytest.raises(ValueError, match="prompt_weighting must be one of"):
        update_settings(prompt_weighting="prompts")


def test_prompt_weights_of_a_step():
    """The row weights come from the whole step; a mini-batch's normaliser is sum_r c_r T_r over its rows; the
    rows without group ids are grouped by their prompt token ids; under tokens nothing is multiplied."""
    lengths = torch.tensor([len(c) for c in COMPLETIONS], dtype=torch.float64)
    equal = PromptWeights("equal", PROMPTS, COMPLETIONS, GROUPS)
    n = float(lengths.sum())
    want = torch.tensor(reference_row_weights("equal"), dtype=torch.float64) * n
    torch.testing.assert_close(equal.row_weights, want, rtol=1e-15, atol=0)
    rows = torch.tensor([3, 0, 9, 14])
    assert equal.tokens(rows) == pytest.approx(float((want * lengths)[rows].sum()), rel=1e-15)
    assert equal.tokens(torch.arange(len(ROWS))) == pytest.approx(n, rel=1e-14)
    x = torch.ones(2, 7)
    torch.testing.assert_close(equal.weigh(x, torch.tensor([5, 1])), want[[5, 1]].unsqueeze(-1).expand(2, 7).float())
    rc = torch.full((2, 7), 0.5, dtype=torch.float64)
    torch.testing.assert_close(equal.loss_weights(torch.tensor([5, 1]), rc, x), 0.5 * want[[5, 1]].unsqueeze(-1) * x)
    torch.testing.assert_close(
        equal.loss_weights(torch.tensor([5, 1]), None, x), (want[[5, 1]].unsqueeze(-1) * x).float()
    )

    tokens = PromptWeights("tokens", PROMPTS, COMPLETIONS, GROUPS)
    assert tokens.row_weights is None and tokens.tokens(rows) == float(lengths[rows].sum())
    assert tokens.weigh(x, rows) is x and tokens.loss_weights(rows, rc, x) is rc
    assert tokens.loss_weights(rows, None, x) is None

    # without group ids, groups 0 and 3 (the same prompt tokens) are one prompt
    by_prompt = PromptWeights("equal", PROMPTS, COMPLETIONS)
    merged = np.where(GROUPS == 3, 0, GROUPS)
    torch.testing.assert_close(by_prompt.row_weights, PromptWeights("equal", PROMPTS, COMPLETIONS, merged).row_weights)
    assert not torch.allclose(by_prompt.row_weights, equal.row_weights)
    with pytest.raises(ValueError, match="3 group ids for 16 rollouts"):
        PromptWeights("equal", PROMPTS, COMPLETIONS, [0, 1, 2])


def test_the_update_reports_the_weighting_and_the_effective_prompts(random_checkpoints):
    """effective_prompts over the prompts with a non-zero advantage (group 1's are all 0): under equal their
    number, under tokens (sum T_i)^2 / sum T_i^2."""
    a, _ = random_checkpoints
    t = [6, 9, 3, 29]  # the completion tokens of groups 0, 2, 3 and 4
    for weighting, want in (("tokens", sum(t) ** 2 / sum(x * x for x in t)), ("equal", 4.0)):
        m = PolicyTrainer(a, update_settings(prompt_weighting=weighting, **LR0)).update(
            PROMPTS, COMPLETIONS, ADV, None, GROUPS
        )
        assert m["prompt_weighting"] == weighting and m["effective_prompts"] == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Exactness: the trainer's gradients are those of the loss written out
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize(("mini_batches", "epochs"), [(1, 1), (3, 2)])
@pytest.mark.parametrize("weighting", ["tokens", "equal"])
def test_every_optimizer_steps_gradient_is_the_weighted_loss_of_its_mini_batch(
    random_checkpoints, mini_batch_rows, shared_prefix, mini_batches, epochs, weighting
):
    """Micro-batches of 2 rows, rows with advantage 0 left out of the passes or not: each optimizer step's
    gradient equals the gradient of sum_r c_r sum_t L_rt / sum_r c_r T_r over its mini-batch's rows within
    1e-10 (float64). With one mini-batch under equal that is (1/M) sum_i (1/T_i) sum_{t in i} L_t, M = 5 (the
    all-equal group counts); the equal gradient is not the token mean's."""
    a, _ = random_checkpoints
    for skip in (True, False):
        mini_batch_rows.clear()
        s = update_settings(
            **LR0,
            mini_batches=mini_batches,
            update_epochs=epochs,
            shared_prefix=shared_prefix,
            skip_zero_advantage=skip,
            prompt_weighting=weighting,
        )
        trainer = float64_trainer(a, s)
        steps = captured_steps(trainer)
        metrics = trainer.update(PROMPTS, COMPLETIONS, ADV, None, GROUPS)
        assert len(steps) == len(mini_batch_rows) == mini_batches * epochs == metrics["optimizer_steps"]
        assert sorted(r for rows in mini_batch_rows[:mini_batches] for r in rows) == list(range(len(ROWS)))
        assert metrics["skipped_rows"] == (int((ADV == 0).sum()) if skip else 0)
        for k, (got, rows) in enumerate(zip(steps, mini_batch_rows, strict=True)):
            assert_close(got, direct_gradient(trainer, rows, weighting), TOL[shared_prefix])
            if mini_batches == 1:
                loss = float(direct_loss(trainer, rows, weighting).detach())
                assert metrics["loss"] == pytest.approx(loss, rel=1e-12), k
        if weighting == "equal" and mini_batches == 1:
            by_group = {}
            for r, g in enumerate(GROUPS):
                by_group.setdefault(int(g), []).append(r)
            mean = sum(
                -sum(float(ADV[r]) * len(COMPLETIONS[r]) for r in rows) / sum(len(COMPLETIONS[r]) for r in rows)
                for rows in by_group.values()
            ) / len(by_group)
            assert metrics["loss"] == pytest.approx(mean, rel=1e-12)  # (1/M) sum_i mean_i(-A) at rho = 1
            tokens_gradient = direct_gradient(trainer, range(len(ROWS)), "tokens")
            assert float((steps[0] - tokens_gradient).norm()) > 1e-3 * float(tokens_gradient.norm())


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_equal_weights_multiply_the_rollout_correction_and_the_kl_term(
    random_checkpoints, mini_batch_rows, shared_prefix
):
    """Token-level rollout correction (some weights capped), then a KL term to a reference moved off the policy:
    every step's gradient is the written-out loss's, with c_r times the correction's weight on each token and
    the KL's per-token terms weighted by c_r too."""
    a, _ = random_checkpoints
    gen = torch.Generator().manual_seed(0)
    probe = float64_trainer(a, update_settings(**LR0))
    with torch.no_grad():
        exact = [row_logprobs(probe.model, probe, p, c).tolist() for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    sampler = [[x - float(torch.empty(()).uniform_(-0.5, 0.5, generator=gen)) for x in row] for row in exact]
    base = {**LR0, "mini_batches": 2, "shared_prefix": shared_prefix, "prompt_weighting": "equal"}
    cases = [
        ({"rollout_correction": "token", "rollout_correction_cap": 1.3}, {"sampler": sampler, "cap": 1.3}),
        ({"kl_coef": 0.5}, {"kl_coef": 0.5}),
    ]
    for extra, direct in cases:
        mini_batch_rows.clear()
        trainer = float64_trainer(a, update_settings(**base, **extra))
        if trainer.ref_model is not None:
            with torch.no_grad():
                for p in trainer.ref_model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        steps = captured_steps(trainer)
        trainer.update(PROMPTS, COMPLETIONS, ADV, sampler if "sampler" in direct else None, GROUPS)
        assert len(steps) == 2
        for got, rows in zip(steps, mini_batch_rows, strict=True):
            assert_close(got, direct_gradient(trainer, rows, "equal", **direct), TOL[shared_prefix])


def test_lora_trains_on_the_equal_weighted_loss(random_checkpoints, mini_batch_rows):
    """With LoRA adapters the gradient of the adapters is the written-out loss's, on both update paths."""
    a, _ = random_checkpoints
    for shared_prefix in (True, False):
        mini_batch_rows.clear()
        s = update_settings(**LR0, lora_rank=4, lora_alpha=8.0, shared_prefix=shared_prefix, prompt_weighting="equal")
        trainer = float64_trainer(a, s)
        with torch.no_grad():  # B starts at 0 (the adapter adds nothing): give both matrices a gradient
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
        steps = captured_steps(trainer)
        trainer.update(PROMPTS, COMPLETIONS, ADV, None, GROUPS)
        n_adapter = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        assert n_adapter < sum(p.numel() for p in trainer.model.parameters())
        assert_close(steps[0], direct_gradient(trainer, mini_batch_rows[0], "equal"), TOL[shared_prefix])


class OneRank(DataShard):
    """Rank ``rank`` of ``world`` run alone. Its gradients stay its own (the test adds the ranks' up); the one
    tensor the update sums over the ranks, the log-probabilities before the update (each rank computes its
    share of the rows), comes back as ``whole``, what the shares sum to: the single-process figures."""

    def __init__(self, rank: int, world: int, whole: torch.Tensor) -> None:
        self.rank, self.world, self.whole = rank, world, whole

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        mine = t != 0
        assert t.shape == self.whole.shape and bool(mine.any())
        assert torch.allclose(t[mine], self.whole[mine], rtol=1e-12, atol=0)
        return self.whole.clone()


def test_data_parallel_ranks_sum_to_the_single_process_gradient(random_checkpoints):
    """Each FSDP rank computes its share of each mini-batch with the weights and normaliser of the whole step,
    so the ranks' gradients (here: two ranks run one after the other, each with its own share) sum to the
    single-process gradient of every optimizer step."""
    a, _ = random_checkpoints
    s = update_settings(**LR0, mini_batches=2, update_epochs=2, shared_prefix=False, prompt_weighting="equal")
    single = float64_trainer(a, s)
    want = captured_steps(single)
    summed: list[torch.Tensor] = []
    single.shard.sum = lambda t: summed.append(t.clone()) or t
    single.update(PROMPTS, COMPLETIONS, ADV, None, GROUPS)
    assert len(summed) == 1  # logp_old (no KL reference)
    ranks = []
    for rank in range(2):
        trainer = float64_trainer(a, s)
        trainer.shard = OneRank(rank, 2, summed[0])
        ranks.append(captured_steps(trainer))
        trainer.update(PROMPTS, COMPLETIONS, ADV, None, GROUPS)
    assert len(want) == len(ranks[0]) == len(ranks[1]) == 4
    for got0, got1, whole in zip(*ranks, want, strict=True):
        assert_close(got0 + got1, whole, rel=1e-12)
        assert float(got0.norm()) > 0 and float(got1.norm()) > 0


# ---------------------------------------------------------------------------------------------
# tokens is the update as it was; equal is tokens when every prompt has as many tokens
# ---------------------------------------------------------------------------------------------


def test_tokens_hands_the_loss_no_weights(random_checkpoints, monkeypatch):
    """Under tokens (the default) ``policy_loss`` gets ``weights=None`` and the token count of the mini-batch,
    as before prompt weighting existed, on both paths; the group ids change nothing, bit for bit."""
    a, _ = random_checkpoints
    calls = []
    loss = update_module.policy_loss

    def spy(*args, **kwargs):
        calls.append((kwargs["weights"], kwargs["token_count"]))
        return loss(*args, **kwargs)

    monkeypatch.setattr(update_module, "policy_loss", spy)
    n = float(sum(len(c) for c in COMPLETIONS))
    for shared_prefix in (True, False):
        s = update_settings(lr=1e-2, micro_batch_size=3, shared_prefix=shared_prefix)
        runs = []
        for groups in (None, GROUPS, np.arange(len(ROWS))):
            calls.clear()
            trainer = PolicyTrainer(a, s)
            m = trainer.update(PROMPTS, COMPLETIONS, ADV, None, groups)
            assert calls and all(w is None and count == n for w, count in calls), shared_prefix
            runs.append((dict(trainer.model.state_dict()), m))
        (p0, m0), *others = runs
        for p, m in others:
            assert all(torch.equal(p0[k], p[k]) for k in p0) and m["loss"] == m0["loss"]
            assert m["grad_norm"] == m0["grad_norm"]


EVEN_GROUPS = np.array([0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3])
EVEN_PROMPTS = [P0] * 2 + [P1] * 4 + [P2] * 3 + [P3] * 2
EVEN_COMPLETIONS = [  # every group has 12 completion tokens, in 2, 4, 3 and 2 rollouts
    [20, 21, 22, 23, 24, 2],
    [25, 26, 27, 28, 29, 2],
    [30, 31, 2],
    [32, 2],
    [33, 34, 35, 36, 2],
    [37, 2],
    [40, 41, 42, 43, 2],
    [44, 45, 46, 2],
    [47, 48, 2],
    [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60],
    [2],
]
EVEN_ADV = np.array([0.7, -0.7, 1.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -0.7, 0.7])


@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize(("mini_batches", "epochs", "kl_coef"), [(1, 1, 0.0), (3, 2, 0.1)])
def test_equal_is_tokens_bit_for_bit_when_every_prompt_has_as_many_tokens(
    random_checkpoints, shared_prefix, mini_batches, epochs, kl_coef
):
    """Every group 12 completion tokens (one all-equal group among them, which counts in M as in the token
    mean's normaliser): each row's weight is N / (M * T_i) = 1 exactly, so two updates (weights moving) give the
    same parameters, loss and gradient norm bit for bit."""
    a, _ = random_checkpoints
    assert (
        len({sum(len(c) for c, g in zip(EVEN_COMPLETIONS, EVEN_GROUPS, strict=True) if g == k) for k in range(4)}) == 1
    )
    runs = {}
    for weighting in ("tokens", "equal"):
        s = update_settings(
            lr=1e-2,
            micro_batch_size=2,
            mini_batches=mini_batches,
            update_epochs=epochs,
            kl_coef=kl_coef,
            shared_prefix=shared_prefix,
            prompt_weighting=weighting,
        )
        trainer = PolicyTrainer(a, s)
        m1 = trainer.update(EVEN_PROMPTS, EVEN_COMPLETIONS, EVEN_ADV, None, EVEN_GROUPS)
        m2 = trainer.update(EVEN_PROMPTS, EVEN_COMPLETIONS, -EVEN_ADV, None, EVEN_GROUPS)
        runs[weighting] = (dict(trainer.model.state_dict()), m1, m2)
    (p_t, *m_t), (p_e, *m_e) = runs["tokens"], runs["equal"]
    assert all(torch.equal(p_t[k], p_e[k]) for k in p_t)
    for t, e in zip(m_t, m_e, strict=True):
        for key in ("loss", "grad_norm", "kl", "clip_frac", "entropy"):
            assert t[key] == e[key] or (math.isnan(t[key]) and math.isnan(e[key])), key
        assert e["effective_prompts"] == pytest.approx(3.0, rel=1e-12) and t["effective_prompts"] == 3.0
