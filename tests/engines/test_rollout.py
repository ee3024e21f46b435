"""Rollout backends: vLLM on CPU against transformers, reloads, per-prompt n, seeds.

The tests on the module's shared engine come first: vLLM's in-process engines share the process's
parallel-state globals, and closing a second engine (the tests that start their own) tears them down.
"""

from __future__ import annotations

import pytest
from char_prompts import char_ids

from coba_tasks.engines.rollout import (
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
        RolloutRequest(f"p{i}", char_ids(p), n=k, seed=rollout_seed(7, seed_step, f"p{i}"), prompt=p)
        for i, (p, k) in enumerate(zip(PROMPTS, sizes, strict=True))
    ]


def tensors_of(checkpoint):
    """A ``set_weights`` source: the tensors of a checkpoint directory, read into memory."""
    from safetensors.torch import load_file

    return lambda: load_file(str(checkpoint / "model.safetensors")).items()


@pytest.fixture(scope="module")
def vllm_engine(random_checkpoints):
    a, _ = random_checkpoints
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0)
    yield engine
    engine.close()


def test_an_eager_cpu_engine_compiles_nothing(vllm_engine):
    """vLLM compiles one sampler helper with torch.compile even with enforce_eager (2-4 s at the first
    generate of every process on 2 cores, for a rank coba never reads): an eager CPU engine turns it off."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    frames = counters["frames"]["total"]
    rows = vllm_engine.generate(requests(3), SamplingConfig(temperature=1.0, max_tokens=6))
    assert len(rows) == 3 * len(PROMPTS) and all(len(r.logprobs) == r.n_tokens for r in rows)
    assert torch._dynamo.config.disable and counters["frames"]["total"] == frames


@pytest.mark.slow
def test_the_rows_are_the_same_without_the_text_of_each_logprobs_token(vllm_engine, monkeypatch):
    """coba has vLLM leave each log-probability's token text undecoded (``skip_logprob_token_text``: a fifth of a
    generate call of the tiny model): the rows (completion text, token ids, the sampled tokens' log-probabilities)
    are those vLLM gives when it decodes them."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    assert LogprobsProcessor._coba_skips_token_text  # the engine's start installed it
    fast = vllm_engine.generate(requests(4), SAMPLE)
    monkeypatch.setattr(LogprobsProcessor, "from_new_request", LogprobsProcessor._coba_decodes_token_text)
    monkeypatch.setattr(LogprobsProcessor, "_update_sample_logprobs", LogprobsProcessor._coba_appends_by_position)
    slow = vllm_engine.generate(requests(4), SAMPLE)
    assert fast == slow and all(len(r.logprobs) == r.n_tokens > 0 for r in fast)


@pytest.mark.parametrize("num_logprobs", [0, 1])
def test_each_steps_logprobs_appended_at_once_are_the_lists_vllm_appends_position_by_position(num_logprobs):
    """``skip_logprob_token_text`` appends a step's sampled-token log-probabilities in one go where a request asks
    for them alone (``logprobs=0``); the lists and the running sum are those of vLLM's loop, also where another
    request of the batch asked for more (a second column) and over several positions (speculative decoding)."""
    pytest.importorskip("vllm")
    import numpy as np
    from vllm.logprobs import FlatLogprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    from coba_tasks.engines.rollout.vllm_backend import skip_logprob_token_text

    assert skip_logprob_token_text()
    steps = [  # (token ids, log-probabilities, ranks) of 1, 3 and 1 positions, two columns each
        (np.array([[5, 9]]), np.array([[-0.25, -0.5]], dtype=np.float32), np.array([2])),
        (
            np.array([[7, 1], [3, 4], [8, 8]]),
            np.array([[-1.5, -0.1], [-0.3, -2.0], [-1e-8, -1e-8]]),
            np.array([1, 3, 1]),
        ),
        (np.array([[2, 6]]), np.array([[-7.0, -0.2]], dtype=np.float32), np.array([4])),
    ]

    def fed(update):
        kept = LogprobsProcessor(None, FlatLogprobs(), None, 0.0, num_logprobs, None)
        for ids, lps, ranks in steps:
            update(kept, LogprobsLists(ids, lps, ranks, None))
        return kept

    fast, vllms = fed(LogprobsProcessor._update_sample_logprobs), fed(LogprobsProcessor._coba_appends_by_position)
    assert vars(fast.logprobs) == vars(vllms.logprobs) and fast.cumulative_logprob == vllms.cumulative_logprob
    assert len(fast.logprobs) == 5  # positions


def test_registry_and_bad_input(tmp_path):
    assert backends() == ["transformers", "vllm", "vllm-ray"]
    with pytest.raises(ValueError, match=r"unknown rollout backend 'sglang'.*transformers, vllm"):
        make_backend("sglang", tmp_path)
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        make_backend("transformers", tmp_path)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)


def test_rollout_seed_is_stable_and_distinct():
    # pinned: a change here changes the rollouts of every recorded run (their seeds come from this hash)
    assert rollout_seed(1, 2, "a") == 1860664061
    assert rollout_seed(1, 2, "b") == 1439943374
    assert rollout_seed(1, 3, "a") == 122195691
    assert rollout_seed(2, 2, "a") == 1372775131
    assert rollout_seed(7, 0, "p0") == 225985958  # the first prompt of requests() above
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


@pytest.mark.parametrize("transport", ["reference", "bytes"])
def test_vllm_takes_weights_from_memory_as_from_their_checkpoint(vllm_engine, random_checkpoints, transport):
    """set_weights (the tensors themselves, or their bytes as another process receives them) gives the rows a
    reload of the same weights from their checkpoint gives, log-probabilities bit for bit."""
    a, b = random_checkpoints
    try:
        vllm_engine.load_weights(b, version=1)
        from_file = vllm_engine.generate(requests(3), SAMPLE)
        vllm_engine.load_weights(a, version=0)
        vllm_engine.weight_transport = transport
        vllm_engine.set_weights(tensors_of(b), version=1)
        from_memory = vllm_engine.generate(requests(3), SAMPLE)
    finally:
        vllm_engine.weight_transport = "reference"
        vllm_engine.load_weights(a, version=0)
    assert from_memory == from_file  # token ids, completions, log-probabilities, weight version 1


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


def test_transformers_backend_refuses_a_model_whose_scores_are_not_finite_in_one_line(random_checkpoints):
    """Weights turned NaN (a diverged update): the rollouts stop with a one-line error naming the weight version and
    the way out, not torch's "probability tensor contains either inf, nan or element < 0"."""
    import torch

    from coba_tasks.engines.rollout.hf_backend import NonFiniteLogitsError

    a, _ = random_checkpoints
    hf = make_backend("transformers", a)
    params = dict(hf.model.named_parameters())
    hf.set_weights(lambda: ((n, torch.full_like(p, float("nan"))) for n, p in params.items()), version=3)
    for sampling in (SAMPLE, GREEDY):
        with pytest.raises(NonFiniteLogitsError) as info:
            hf.generate(requests([2, 1, 1, 1, 1]), sampling)
        message = str(info.value)
        assert message.startswith(
            "rollouts of weight version 3: the model's next-token scores are NaN or +inf in 6 of 6"
        )
        assert "lower optim.lr" in message and "\n" not in message


def _teacher_forced(model_dir, prompt_ids, completion_ids, temperature: float = 1.0) -> list[float]:
    """log_softmax(z / T) of each completion token given the prompt (float32): the sampling distribution."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logp = (model(input_ids=ids).logits[0, :-1].float() / temperature).log_softmax(-1)  # (T-1, V)
    rows = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
    return logp[rows, ids[0, len(prompt_ids) :]].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_and_trainer_logprobs_are_of_the_sampling_distribution(vllm_engine, random_checkpoints, temperature):
    """At temperature T every recorded sampler log-prob equals log_softmax(z / T) of the same weights within
    1e-4, and so do the trainer's (its recorded train/rollout gap, both update paths): the policy gradient is
    taken for the distribution the rollouts were drawn from."""
    import numpy as np

    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    a, _ = random_checkpoints
    sampling = SamplingConfig(temperature=temperature, max_tokens=8)
    by_id = {r.prompt_id: r for r in requests(1)}
    for backend in (vllm_engine, make_backend("transformers", a)):
        rows = backend.generate(requests([3, 2, 1, 2, 2]), sampling)
        for r in rows:
            assert len(r.logprobs) == r.n_tokens > 0
            expected = _teacher_forced(a, by_id[r.prompt_id].prompt_token_ids, r.token_ids, temperature)
            assert r.logprobs == pytest.approx(expected, abs=1e-4), (backend.name, r.prompt_id, r.sample_idx)
        if temperature != 1.0:  # the raw (temperature 1) log-probs are far off: the check can tell them apart
            raw = [x for r in rows for x in _teacher_forced(a, by_id[r.prompt_id].prompt_token_ids, r.token_ids)]
            assert max(abs(x - y) for x, y in zip(raw, [x for r in rows for x in r.logprobs], strict=True)) > 1e-2
        prompts = [by_id[r.prompt_id].prompt_token_ids for r in rows]
        for shared_prefix in (True, False):
            # zero advantages with the skip on would leave every row out and nothing to compare
            settings = update_settings(
                lr=1e-6, temperature=temperature, shared_prefix=shared_prefix, skip_zero_advantage=False
            )
            metrics = PolicyTrainer(a, settings).update(
                prompts, [r.token_ids for r in rows], np.zeros(len(rows)), [r.logprobs for r in rows]
            )
            assert metrics["logprob_diff_max"] < 1e-4, (backend.name, shared_prefix, metrics["logprob_diff_max"])


@pytest.mark.slow
def test_vllm_groups_stay_a_function_of_their_seed_when_prompts_exceed_a_prefill_chunk(vllm_engine):
    """Hundreds of sampled sequences of 40-token prompts: more prompt tokens than one engine step takes.
    vLLM on CPU split such prefills into chunks, and a seeded request with a chunked prefill crashed the
    engine ("CPU Generator does not use offset"); a group must also not depend on the rest of the batch."""
    prompts = ["+".join(str(10 + k + 7 * i) for i in range(12)) + "=" for k in range(120)]
    assert min(len(p) for p in prompts) >= 32  # 120 prompts x 4 samples x >= 32 tokens: > 15,000 prompt tokens
    reqs = [
        RolloutRequest(f"q{k}", char_ids(p), 4, rollout_seed(3, 0, f"q{k}"), prompt=p) for k, p in enumerate(prompts)
    ]
    rows = vllm_engine.generate(reqs, SAMPLE)
    assert len(rows) == 480
    for k in (0, 77, 119):
        alone = vllm_engine.generate(reqs[k : k + 1], SAMPLE)
        assert [r.token_ids for r in alone] == [r.token_ids for r in rows if r.prompt_id == f"q{k}"]


@pytest.mark.slow
def test_one_engine_call_for_sampled_and_greedy_gives_each_its_own_completions(vllm_engine):
    """generate_many runs a sampled and a greedy batch in one vLLM call: each batch's rows equal what its own
    call gives (seeds are per request), so an evaluation that asks for both measures the same as before."""
    sampled = SamplingConfig(temperature=1.0, top_p=0.9, max_tokens=8)
    both = vllm_engine.generate_many([(requests(4), sampled), (requests(1), GREEDY)])
    alone = [vllm_engine.generate(requests(4), sampled), vllm_engine.generate(requests(1), GREEDY)]
    for together, apart in zip(both, alone, strict=True):
        assert [(r.prompt_id, r.sample_idx, r.token_ids) for r in together] == [
            (r.prompt_id, r.sample_idx, r.token_ids) for r in apart
        ]
        for x, y in zip(together, apart, strict=True):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert len(both[0]) == 4 * len(PROMPTS) and len(both[1]) == len(PROMPTS)
    assert vllm_engine.generate_many([]) == [] and vllm_engine.generate_many([([], GREEDY)]) == [[]]


@pytest.mark.slow
def test_top_p_without_the_sort_samples_what_vllms_own_top_p_samples(vllm_engine):
    """The engine's sort-free nucleus (the default) gives the completions and log-probabilities of vLLM's own
    top-p from the same seeds, and the nucleus does cut the distribution (top-p 1.0 samples otherwise)."""
    nucleus = SamplingConfig(temperature=1.0, top_p=0.7, max_tokens=8)
    vllm_engine.sort_free_top_p = False
    try:
        own = vllm_engine.generate(requests(4), nucleus)
    finally:
        vllm_engine.sort_free_top_p = True
    fast = vllm_engine.generate(requests(4), nucleus)
    assert [r.token_ids for r in fast] == [r.token_ids for r in own]
    for x, y in zip(fast, own, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    whole = vllm_engine.generate(requests(4), SAMPLE)
    cut = [
        x.token_ids != y.token_ids or max(abs(a - b) for a, b in zip(x.logprobs, y.logprobs, strict=True)) > 1e-3
        for x, y in zip(whole, fast, strict=True)
    ]
    assert sum(cut) > len(cut) // 2, cut


@pytest.mark.slow
def test_vllm_reload_drops_the_prefix_cache(random_checkpoints):
    """A prompt that fills a KV block leaves it in vLLM's prefix cache; those blocks were computed with
    the old weights, so after a reload they must not be reused (32-token blocks: the CPU's smallest)."""
    a, b = random_checkpoints
    long_prompt = [RolloutRequest("long", char_ids("12+34+56+78+90+12+34+56+78+90+11+22+33+44="), 1, 0)]  # 42 tokens
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0, extra={"block_size": 32})
    try:
        engine.generate(long_prompt, GREEDY)
        engine.load_weights(b, version=1)
        after = engine.generate(long_prompt, GREEDY)
    finally:
        engine.close()
    expected = make_backend("transformers", b).generate(long_prompt, GREEDY)
    assert after[0].token_ids == expected[0].token_ids


@pytest.mark.slow
def test_vllm_reload_of_a_model_with_tied_embeddings_follows_the_new_weights(tied_checkpoints):
    """Tied input/output embeddings: the output projection has no tensor of its own in the checkpoint;
    after an in-place reload vLLM must still multiply by the new embedding (greedy equals transformers')."""
    a, b = tied_checkpoints
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0)
    try:
        before = engine.generate(requests(1), GREEDY)
        engine.load_weights(b, version=1)
        after = engine.generate(requests(1), GREEDY)
        engine.load_weights(a, version=0)
        engine.set_weights(tensors_of(b), version=1)  # from memory: the embedding once, as the checkpoint has it
        after_memory = engine.generate(requests(1), GREEDY)
    finally:
        engine.close()
    expected = make_backend("transformers", b).generate(requests(1), GREEDY)
    # a random model with tied embeddings mostly repeats its input, so greedy tokens alone say little:
    # the log-probabilities of those tokens tell the old output projection from the new one
    assert [r.token_ids for r in after] == [r.token_ids for r in expected]
    for got, want, old in zip(after, expected, before, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert old.logprobs != pytest.approx(want.logprobs, abs=1e-2)  # the weights did change
    assert after_memory == after


def test_the_weight_transport_is_the_one_the_engines_place_allows():
    """auto: the tensors themselves in this process, CUDA IPC to an engine process on one GPU, else bytes; a
    transport the engine cannot use is refused in one line that names the way out."""
    from coba_tasks.engines.rollout.vllm_backend import _transport

    assert _transport("auto", in_process=True, on_cpu=True, tp=1) == "reference"
    assert _transport("auto", in_process=False, on_cpu=False, tp=1) == "ipc"
    assert _transport("auto", in_process=False, on_cpu=True, tp=1) == "bytes"
    assert _transport("auto", in_process=False, on_cpu=False, tp=2) == "bytes"
    assert _transport("bytes", in_process=False, on_cpu=False, tp=1) == "bytes"
    with pytest.raises(
        ValueError, match=r"^weight_transport=ipc: CUDA IPC needs .* on the GPU; use weight_transport=auto$"
    ):
        _transport("ipc", in_process=False, on_cpu=True, tp=1)
    with pytest.raises(ValueError, match=r"^weight_transport=reference: the engine runs in a process of its own"):
        _transport("reference", in_process=False, on_cpu=False, tp=1)
    with pytest.raises(ValueError, match=r"^weight_transport must be one of auto, reference, ipc, bytes; got 'nccl'"):
        _transport("nccl", in_process=True, on_cpu=True, tp=1)
