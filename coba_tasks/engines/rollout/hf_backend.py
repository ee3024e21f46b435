"""The ``transformers`` rollout backend: ``model.generate`` on CPU or GPU, where vLLM cannot run.

The same interface and rows as the vLLM backend (it is the tests' reference for them). Each prompt's
group is sampled in a fork of the global RNG seeded with the prompt's seed, so a group does not depend
on the rest of the batch. Sleep moves the model to CPU memory. The sampler log-probabilities are
of the distribution each token was sampled from (generate's processed scores: after temperature and
top-p), as the trainer computes them (log_softmax(logits / T)) and as the vLLM backend records them.

Only the sampling settings coba-rl controls reach ``generate`` (``generation_config``: sampling or
greedy, temperature, top-p, no top-k, the token budget, the tokenizer's eos and pad ids). A model
directory's own ``generation_config.json`` (a repetition penalty, an n-gram ban, min-p, top-k...:
Qwen2.5-Instruct ships one) is set aside when the model loads, since ``generate`` fills every setting
left unset from it: the rollouts are then drawn from log_softmax(z / T), the distribution the trainer
computes, and greedy decoding takes argmax z.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coba_tasks.engines.rollout.base import Rollout, RolloutBackend, RolloutRequest, SamplingConfig, register_backend


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
        batch_prompts: int = 1,
        **_: Any,
    ) -> None:
        super().__init__()
        import torch
        from transformers import AutoTokenizer

        self._torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype) if dtype != "auto" else torch.float32
        self.trust_remote_code = trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._load(model_path)

    def _load(self, path: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, trust_remote_code=self.trust_remote_code
        ).to(self.device)
        self.model.eval()
        self.model.generation_config = _neutral_generation_config()  # not the directory's generation_config.json
        self.model_path = str(path)

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        torch = self._torch
        self.check_requests(requests)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        rows: list[Rollout] = []
        for r in requests:
            ids = torch.tensor([r.prompt_token_ids], dtype=torch.long, device=self.device)  # (1, P)
            config = generation_config(sampling, r.n, eos, pad)
            with torch.random.fork_rng(devices=[] if self.device == "cpu" else None), torch.no_grad():
                torch.manual_seed(r.seed)
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            new_tokens = out.sequences[:, ids.shape[1] :]  # (n, L)
            logits = torch.stack(out.scores, dim=1).float()  # (n, L, V): what each token was drawn from
            token_logp = logits.log_softmax(-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # (n, L)
            for j, (seq, logp) in enumerate(zip(new_tokens.tolist(), token_logp.tolist(), strict=True)):
                finish = "length"
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
                        logprobs=tuple(logp[: len(seq)]),
                    )
                )
        return rows

    def load_weights(self, path: str | Path, version: int) -> None:
        self._load(path)
        self.weight_version = int(version)

    def sleep(self) -> None:
        """Move the model to CPU memory until ``wake_up`` (a no-op on CPU)."""
        if self.device != "cpu" and self.model is not None:
            self.model.to("cpu")
            self._torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device != "cpu" and self.model is not None:
            self.model.to(self.device)

    def close(self) -> None:
        self.model = None


def _neutral_generation_config() -> Any:
    """A generation config that sets nothing: ``generate`` fills what a call leaves unset from the model's
    generation config, then from transformers' defaults (no penalty, no n-gram ban, no min-p)."""
    from transformers import GenerationConfig

    return GenerationConfig()


def generation_config(sampling: SamplingConfig, n: int, eos: int | None, pad: int | None) -> Any:
    """The ``GenerationConfig`` of one prompt's group: ``n`` completions, sampled at the temperature and
    top-p of ``sampling`` with no top-k (greedy at temperature 0), at most ``sampling.max_tokens`` new
    tokens, stopping at ``eos``; every logits processor beyond those is off."""
    from transformers import GenerationConfig

    greedy = sampling.temperature == 0.0
    return GenerationConfig(
        max_new_tokens=sampling.max_tokens,
        do_sample=not greedy,
        num_return_sequences=n,
        pad_token_id=pad,
        eos_token_id=eos,
        return_dict_in_generate=True,
        output_scores=True,  # processed logits (after temperature and top-p): the sampling distribution
        temperature=1.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0,
        min_p=None,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
    )
