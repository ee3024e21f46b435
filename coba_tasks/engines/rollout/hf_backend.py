"""The ``transformers`` rollout backend: ``model.generate`` on CPU or GPU, where vLLM cannot run, and the
tests' reference for the vLLM backend's rows.

Groups are generated in batches (prompts of one length together, left-padded where lengths differ, at most
``max_num_seqs`` sequences and, on CUDA, what ``gpu_memory_utilization`` leaves room for: ``rows_that_fit``).
Each group draws its tokens with a generator seeded with its seed (``_GroupSampler``), so it gets the tokens
it would get alone (up to float rounding of a padded batch). A model directory's own
``generation_config.json`` (a repetition penalty, min-p...: Qwen2.5-Instruct ships one) is set aside, since
``generate`` fills every setting left unset from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from coba_tasks.engines.rollout.base import Rollout, RolloutBackend, RolloutRequest, SamplingConfig, register_backend

if TYPE_CHECKING:
    from coba_tasks.engines.rollout.base import WeightsSource

MAX_NUM_SEQS = 256  # sequences per generate call at most (vLLM's default max_num_seqs)
# float32 (sequences x vocabulary) tensors alive at once in one decoding step: the model's last logits, their
# float32 copy, the warped scores, the probabilities, their log-softmax, the forced scores
_VOCAB_ROWS_PER_SEQ = 6


class NonFiniteLogitsError(ValueError):
    """The model's next-token scores hold NaN or +inf: its weights are not finite (a diverged update), so no
    completion can be sampled from them."""


@register_backend("transformers")
class TransformersBackend(RolloutBackend):
    """``model.generate`` on CPU or GPU: the fallback where vLLM cannot run."""

    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = MAX_NUM_SEQS,
        **_: Any,
    ) -> None:
        super().__init__()
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype) if dtype != "auto" else torch.float32
        self.trust_remote_code = trust_remote_code
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_num_seqs = max_num_seqs
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._load(model_path)

    def _load(self, path: str | Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, trust_remote_code=self.trust_remote_code
        ).to(self.device)
        self.model.eval()
        # a config that sets nothing, not the directory's generation_config.json: generate fills what a call
        # leaves unset from transformers' defaults (no penalty, no n-gram ban, no min-p)
        self.model.generation_config = GenerationConfig()
        self.model_path = str(path)

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        self.check_requests(requests)
        if not requests:  # no work, as the vLLM backend answers it
            return []
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        groups: list[list[Rollout]] = [[] for _ in requests]
        for batch in self._batches(requests, sampling.max_tokens):
            try:
                made = self._generate_batch([requests[i] for i in batch], sampling, eos, pad)
            except NonFiniteLogitsError as e:
                raise NonFiniteLogitsError(f"rollouts of weight version {self.weight_version}: {e}") from None
            for i, rows in zip(batch, made, strict=True):
                groups[i] = rows
        return [row for rows in groups for row in rows]

    def _batches(self, requests: Sequence[RolloutRequest], max_tokens: int) -> list[list[int]]:
        """The requests' indices cut into the batches of one ``generate`` call each: by prompt length, a group
        never split, at most ``max_rows`` sequences a batch (one group alone when it is larger)."""
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_token_ids))
        longest = max(len(r.prompt_token_ids) for r in requests)
        max_rows = self.max_rows(longest, max_tokens)
        batches: list[list[int]] = []
        rows = 0
        for i in order:
            n = requests[i].n
            if batches and rows + n <= max_rows:
                batches[-1].append(i)
                rows += n
            else:
                batches.append([i])
                rows = n
        return batches

    def max_rows(self, prompt_len: int, max_tokens: int) -> int:
        """Sequences per ``generate`` call: ``max_num_seqs``, and on CUDA at most what fits in the share
        ``gpu_memory_utilization`` of the GPU's memory beside what is allocated already (the weights)."""
        if self.device == "cpu" or not torch.cuda.is_available():
            return self.max_num_seqs
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = self.gpu_memory_utilization * total - torch.cuda.memory_allocated(self.device)
        fit = rows_that_fit(self.model.config, prompt_len, max_tokens, budget, self.dtype)
        return max(1, min(self.max_num_seqs, fit))

    def _generate_batch(
        self, requests: Sequence[RolloutRequest], sampling: SamplingConfig, eos: int | None, pad: int | None
    ) -> list[list[Rollout]]:
        """One ``generate`` call for the groups of ``requests``: each group's rows."""
        longest = max(len(r.prompt_token_ids) for r in requests)
        ids, mask, spans = [], [], []
        for r in requests:
            gap = longest - len(r.prompt_token_ids)  # left padding: every prompt ends where generation starts
            row = [pad if pad is not None else 0] * gap + list(r.prompt_token_ids)
            start = len(ids)
            ids += [row] * r.n
            mask += [[0] * gap + [1] * len(r.prompt_token_ids)] * r.n
            spans.append((start, start + r.n, r.seed))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # (B, P)
        sampler = _GroupSampler(spans, sampling, self.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.tensor(mask, dtype=torch.long, device=self.device),
                generation_config=generation_config(sampling, eos, pad),
                logits_processor=LogitsProcessorList([sampler]),
            )
        new_tokens = out[:, longest:].tolist()  # (B, L)
        token_logp = sampler.token_logprobs().tolist()  # (B, >= L)
        groups = []
        for r, (start, end, _) in zip(requests, spans, strict=True):
            rows = []
            for j, b in enumerate(range(start, end)):
                seq, finish = new_tokens[b], "length"
                if eos in seq:
                    seq = seq[: seq.index(eos) + 1]
                    finish = "stop"
                text_ids = [t for t in seq if t not in (eos, pad)]
                rows.append(
                    Rollout(
                        prompt_id=r.prompt_id,
                        sample_idx=j,
                        completion=self.tokenizer.decode(text_ids, skip_special_tokens=True),
                        token_ids=tuple(seq),
                        n_tokens=len(seq),
                        finish_reason=finish,
                        seed=r.seed,
                        weight_version=self.weight_version,
                        logprobs=tuple(token_logp[b][: len(seq)]),
                    )
                )
            groups.append(rows)
        return groups

    def load_weights(self, path: str | Path, version: int) -> None:
        self._load(path)
        self.weight_version = int(version)

    def set_weights(self, source: WeightsSource, version: int) -> None:
        """Each tensor copied into the model's parameter of its name (tied parameters: one name is enough); a
        name the model does not have, or a parameter left without a tensor, is an error before any copy."""
        params = self.model.state_dict(keep_vars=True)
        pairs = list(source())
        unknown = [name for name, _ in pairs if name not in params]
        given = {params[name].data_ptr() for name, _ in pairs if name in params}
        missing = [name for name, p in params.items() if p.data_ptr() not in given]
        if unknown or missing:
            raise ValueError(f"set_weights: unknown tensors {unknown[:3]}, parameters without one {missing[:3]}")
        with torch.no_grad():
            for name, tensor in pairs:
                params[name].copy_(tensor)
        self.weight_version = int(version)

    def sleep(self) -> None:  # the model to CPU memory until wake_up
        if self.device != "cpu" and self.model is not None:
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device != "cpu" and self.model is not None:
            self.model.to(self.device)

    def close(self) -> None:
        self.model = None


class _GroupSampler(LogitsProcessor):
    """The last logits processor of a batch's ``generate``: it draws every sequence's next token itself, with its
    group's own generator (``spans``: rows ``start:end``, seed) from the scores after temperature and top-p
    (argmax at temperature 0), keeps its log-probability, and leaves ``generate`` (greedy) only that token."""

    def __init__(self, spans: Sequence[tuple[int, int, int]], sampling: SamplingConfig, device: str) -> None:
        self.greedy = sampling.temperature == 0.0
        self.warpers = LogitsProcessorList()
        if not self.greedy and sampling.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if not self.greedy and sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
        self.groups = [(start, end, torch.Generator(device=device).manual_seed(seed)) for start, end, seed in spans]
        self.steps: list[torch.Tensor] = []  # (B,) per decoding step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        bad = torch.isnan(scores) | (scores == float("inf"))  # -inf is a token ruled out, NaN and +inf are not
        if bool(bad.any()):
            rows = int(bad.any(-1).sum())
            raise NonFiniteLogitsError(
                f"the model's next-token scores are NaN or +inf in {rows} of {scores.shape[0]} sequences at "
                f"position {len(self.steps)}: its weights are not finite (a diverged update); lower optim.lr and "
                "start again from a checkpoint before it"
            )
        scores = self.warpers(input_ids, scores)  # (B, V) float32
        if self.greedy:
            tokens = scores.argmax(-1)
        else:
            probs = scores.softmax(-1)
            tokens = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
            for start, end, gen in self.groups:
                tokens[start:end] = torch.multinomial(probs[start:end], num_samples=1, generator=gen).squeeze(1)
            del probs
        self.steps.append(scores.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))  # (B,)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(-1, tokens[:, None], 0.0)

    def token_logprobs(self) -> torch.Tensor:  # (B, steps)
        return torch.stack(self.steps, dim=1)


def rows_that_fit(config: Any, prompt_len: int, max_tokens: int, budget_bytes: float, dtype: torch.dtype) -> int:
    """How many sequences of ``prompt_len + max_tokens`` tokens one ``generate`` call can hold in
    ``budget_bytes``: each takes its key-value cache (2 x layers x key-value heads x head size per token, in
    ``dtype``), the prefill's widest activation (prompt x MLP width, three of them) and a few float32 rows of
    the vocabulary (``_VOCAB_ROWS_PER_SEQ``)."""
    text = getattr(config, "text_config", config)
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    width = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    size = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * layers * kv_heads * head_dim * size
    per_row = per_token * (prompt_len + max_tokens) + 3 * prompt_len * width * size
    per_row += _VOCAB_ROWS_PER_SEQ * text.vocab_size * 4
    return int(budget_bytes // per_row) if budget_bytes > 0 else 0


def generation_config(sampling: SamplingConfig, eos: int | None, pad: int | None) -> Any:
    """The ``GenerationConfig`` of one batch: greedy selection of the one token ``_GroupSampler`` leaves, every
    other logits processor off."""
    return GenerationConfig(
        max_new_tokens=sampling.max_tokens,
        do_sample=False,
        num_return_sequences=1,
        pad_token_id=pad,
        eos_token_id=eos,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
    )
