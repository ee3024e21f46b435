"""The transformers backend samples from log_softmax(z / T) whatever the model's generation_config.json says.

A model directory may ship a ``generation_config.json`` with a repetition penalty, an n-gram ban, min-p...
(Qwen2.5-Instruct does). ``model.generate`` applies them unless told otherwise; the rollouts would then not
be drawn from the distribution the trainer computes, log_softmax(z / T), and the recorded log-probs would
differ from the trainer's by the penalty.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from char_prompts import char_ids
from conftest import make_random_checkpoint

from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend, rollout_seed
from coba_tasks.engines.update import PolicyTrainer
from coba_tasks.pipeline.policy import update_settings

PROMPTS = ["37+58=", "1+2=", "99*9="]
PENALTIES = {"repetition_penalty": 3.0, "no_repeat_ngram_size": 1, "min_p": 0.2, "top_k": 5}


@pytest.fixture(scope="module")
def penalised_model(tmp_path_factory):
    """A tiny random model whose generation_config.json asks for a repetition penalty, an n-gram ban, min-p
    and top-k: every one changes the sampled distribution when generate applies it."""
    out = make_random_checkpoint(tmp_path_factory.mktemp("genconfig") / "m", 3)
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **PENALTIES, "do_sample": True, "temperature": 0.3, "top_p": 0.5}))
    return out


def _requests(n: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(f"p{i}", char_ids(p), n=n, seed=rollout_seed(5, 0, f"p{i}"), prompt=p)
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_are_the_trainers_under_a_penalising_generation_config(penalised_model, temperature):
    """Each recorded sampler log-prob equals the trainer's log_softmax(z / T) of the same token (the
    trainer's ``logprob_diff_max``, within 1e-4), though the model's own generation config penalises."""
    engine = make_backend("transformers", penalised_model)
    rows = engine.generate(_requests(4), SamplingConfig(temperature=temperature, max_tokens=12))
    assert all(len(r.logprobs) == r.n_tokens > 0 for r in rows)
    by_id = {r.prompt_id: r.prompt_token_ids for r in _requests(1)}
    settings = update_settings(lr=1e-6, temperature=temperature, skip_zero_advantage=False)
    metrics = PolicyTrainer(penalised_model, settings).update(
        [by_id[r.prompt_id] for r in rows], [r.token_ids for r in rows], np.zeros(len(rows)), [r.logprobs for r in rows]
    )
    assert metrics["logprob_diff_max"] < 1e-4, metrics["logprob_diff_max"]
    # 12 tokens from a vocabulary of ~20 characters: a repeat is all but certain (the ban would forbid it)
    assert any(len(set(r.token_ids)) < len(r.token_ids) for r in rows)


def test_greedy_follows_the_argmax_under_a_penalising_generation_config(penalised_model):
    """Greedy decoding (evaluation) takes argmax z at every token: no penalty moves it off the model's choice."""
    from transformers import AutoModelForCausalLM

    engine = make_backend("transformers", penalised_model)
    rows = engine.generate(_requests(1), SamplingConfig(temperature=0.0, max_tokens=12))
    model = AutoModelForCausalLM.from_pretrained(penalised_model, dtype=torch.float32).eval()
    for r, req in zip(rows, _requests(1), strict=True):
        ids = torch.tensor([list(req.prompt_token_ids) + list(r.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(req.prompt_token_ids) - 1 : -1]  # (L, V)
        assert logits.argmax(-1).tolist() == list(r.token_ids), r.prompt_id
