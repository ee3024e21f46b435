"""The transformers backend generates groups in batches with memory that grows with sequences x length.

Its reference is the backend as it was, prompt by prompt: ``generate`` with ``output_scores``, each group in
a fork of the global RNG seeded with the group's seed, and the scores stacked as an (n, L, V) tensor. The
batched backend must give the same tokens, and the same log-probabilities within float rounding (exactly
the same when each group is a batch of its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from char_prompts import char_ids
from conftest import make_random_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend, rollout_seed
from coba_tasks.engines.rollout.hf_backend import TransformersBackend, rows_that_fit

PROMPTS = ["37+58=", "1+2=", "99*9=", "(4-7)*3=", "12+", "1000-999+998=", "7*7=", "((1+2)*3)="]
SIZES = [3, 5, 1, 4, 2, 6, 3, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("hf") / "m", 0)


def _requests(greedy: bool) -> list[RolloutRequest]:
    return [
        RolloutRequest(f"p{i}", char_ids(p), n=1 if greedy else SIZES[i], seed=rollout_seed(1, 0, f"p{i}"), prompt=p)
        for i, p in enumerate(PROMPTS)
    ]


def _prompt_by_prompt(model_dir, requests, sampling: SamplingConfig) -> list[tuple[str, tuple[int, ...], list[float]]]:
    """The backend as it was: one ``generate`` per group, the global RNG seeded with its seed, scores stacked."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig()
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    greedy = sampling.temperature == 0
    rows = []
    for r in requests:
        config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=not greedy,
            num_return_sequences=r.n,
            pad_token_id=pad,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
            **({} if greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}),
        )
        ids = torch.tensor([r.prompt_token_ids])
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(r.seed)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        new = out.sequences[:, ids.shape[1] :]
        logp = torch.stack(out.scores, dim=1).float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        for seq, lp in zip(new.tolist(), logp.tolist(), strict=True):
            if eos in seq:
                seq = seq[: seq.index(eos) + 1]
            rows.append((r.prompt_id, tuple(seq), lp[: len(seq)]))
    return rows


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(1.0, 1.0, 12), SamplingConfig(0.7, 0.9, 12), SamplingConfig(0.0, 1.0, 12)],
    ids=["T1", "T0.7-top-p0.9", "greedy"],
)
def test_batched_groups_are_the_prompt_by_prompt_groups(model_dir, sampling):
    """Prompts of eight lengths, groups of 1-6: in one batch, in batches of at most 7 sequences (several
    batches, left padding) and one group a batch, the same tokens as prompt by prompt; the log-probabilities
    within float rounding of a padded batch, and bit for bit when each group is a batch of its own."""
    requests = _requests(greedy=sampling.temperature == 0)
    reference = _prompt_by_prompt(model_dir, requests, sampling)
    if sampling.temperature > 0:  # completions of several lengths: eos ends some early
        assert len({len(t) for _, t, _ in reference}) > 1
    for max_num_seqs in (256, 7, 1):
        engine = make_backend("transformers", model_dir, max_num_seqs=max_num_seqs)
        rows = engine.generate(requests, sampling)
        assert [(r.prompt_id, r.token_ids) for r in rows] == [(p, t) for p, t, _ in reference], max_num_seqs
        assert [r.sample_idx for r in rows] == [j for r in requests for j in range(r.n)]
        for r, (_, _, logp) in zip(rows, reference, strict=True):
            assert len(r.logprobs) == r.n_tokens
            if max_num_seqs == 1:
                assert list(r.logprobs) == logp
            else:
                assert list(r.logprobs) == pytest.approx(logp, abs=1e-5)


def test_batches_keep_groups_whole_and_sort_by_prompt_length(model_dir):
    engine = make_backend("transformers", model_dir, max_num_seqs=7)
    requests = _requests(greedy=False)
    batches = engine._batches(requests, max_tokens=12)
    assert sorted(i for b in batches for i in b) == list(range(len(requests)))
    for b in batches:
        assert sum(requests[i].n for i in b) <= 7 or len(b) == 1  # a group larger than the cap goes alone
    lengths = [len(requests[i].prompt_token_ids) for b in batches for i in b]
    assert lengths == sorted(lengths)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        TransformersBackend(model_dir, max_num_seqs=0)


def test_no_requests_give_no_rows_as_vllm_gives_them(model_dir):
    """An empty request list is no work: ``generate`` returns [] (as the vLLM backend does) and
    ``generate_many`` [] per empty batch, and the engine still generates after it."""
    engine = make_backend("transformers", model_dir)
    sampling = SamplingConfig(1.0, 1.0, 4)
    assert engine.generate([], sampling) == []
    assert engine.generate_many([([], sampling), ([], SamplingConfig(0.0, 1.0, 4))]) == [[], []]
    rows = engine.generate(_requests(greedy=True)[:2], SamplingConfig(0.0, 1.0, 4))
    assert [r.prompt_id for r in rows] == ["p0", "p1"]


def test_rows_that_fit_counts_the_cache_the_prefill_and_the_vocabulary():
    """Qwen2.5-0.5B's shape in bfloat16, prompts of 512 and 1536 new tokens: per sequence the key-value cache
    (2 x 24 layers x 2 heads x 64 x 2 bytes = 12,288 bytes a token, x 2048), the prefill's MLP (3 x 512 x
    4864 x 2 bytes) and six float32 vocabulary rows (6 x 151,936 x 4 bytes)."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    )
    per_row = 12288 * 2048 + 3 * 512 * 4864 * 2 + 6 * 151936 * 4
    assert rows_that_fit(config, 512, 1536, 40 * per_row + 1, torch.bfloat16) == 40
    assert rows_that_fit(config, 512, 1536, per_row - 1, torch.bfloat16) == 0
    assert rows_that_fit(config, 512, 1536, -5.0, torch.bfloat16) == 0


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from coba_tasks.engines.model import build_char_tokenizer
    from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend

    out = sys.argv[1]
    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    engine = make_backend("transformers", out)
    request = RolloutRequest("p", tuple(tok("1+2=").input_ids), n=16, seed=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = engine.generate([request], SamplingConfig(temperature=1.0, max_tokens=256))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"grew": peak - before, "tokens": sum(r.n_tokens for r in rows)}))
    """
)


@pytest.mark.slow
def test_memory_grows_with_sequences_and_length_not_the_vocabulary(tmp_path):
    """16 samples of 256 tokens with a vocabulary of 151,936 (Qwen2.5's) on a one-layer model: scores kept
    for every token would be 16 x 256 x 151,936 float32 = 2.5 GB (stacked, then log-softmaxed: 5 GB); the
    batched backend's process grows by well under 1 GB (measured: 74 MB; 7.5 GB as it was).

    glibc hands memory freed by large temporaries back to the OS only above its mmap threshold, which it
    raises as the process runs: the peak resident size then drifts with what the allocator kept (82 MB to
    1.04 GB over runs of the same code). A fixed threshold of 1 MiB makes the peak the memory in use."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "m")], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["tokens"] > 16 * 200  # nearly every sample ran to 256 tokens (eos is 1 token in 151,936)
    assert figures["grew"] < 1 * 2**30, figures


def test_weights_from_memory_give_the_rows_of_their_checkpoint_and_a_wrong_set_is_refused(random_checkpoints):
    from safetensors.torch import load_file

    a, b = random_checkpoints
    reqs = [RolloutRequest("p0", (5, 6, 7), 3, 11), RolloutRequest("p1", (8, 9), 2, 12)]
    sample = SamplingConfig(temperature=1.0, max_tokens=6)
    backend = make_backend("transformers", a)
    backend.load_weights(b, version=1)
    want = backend.generate(reqs, sample)
    backend.load_weights(a, version=0)
    tensors = load_file(str(b / "model.safetensors"))
    backend.set_weights(lambda: tensors.items(), version=1)
    assert backend.generate(reqs, sample) == want
    some = next(iter(tensors))
    with pytest.raises(ValueError, match=r"^set_weights: unknown tensors \['nope'\], parameters without one \["):
        backend.set_weights(lambda: [("nope", tensors[some])], version=2)
    assert backend.weight_version == 1
