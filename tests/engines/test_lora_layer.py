"""The update's LoRA layer: one product with the merged weight, the same layer as peft's.

``MergedLoraLinear`` computes ``x (W + s B A)^T`` where peft computes ``x W^T + s (x A^T) B^T``: the
outputs and the gradients of A, B and the input must agree (exactly up to rounding), and the engine's
merged weights must be the very tensors the trainer multiplies by.
"""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from coba_tasks.engines.lora import MergedLoraLinear, _fast_path, add_lora, merged_state_dict, merged_weight
from coba_tasks.engines.model import TinyLlamaSpec, build_char_tokenizer, build_tiny_llama


def _lora_model(dtype: torch.dtype, targets="all-linear"):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, TinyLlamaSpec(hidden_size=64, intermediate_size=96), seed=0).to(dtype)
    peft_model = add_lora(model, 4, 8.0, targets)
    with torch.no_grad():  # B starts at 0; a trained adapter has B != 0
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return peft_model.get_base_model(), len(tok)


def _loss_and_grads(model, ids, weights, *, peft_forward: bool, monkeypatch, autocast=None):
    with monkeypatch.context() as m:
        if peft_forward:
            m.setattr(MergedLoraLinear, "forward", PeftLoraLinear.forward)
        model.zero_grad(set_to_none=True)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = model(inputs_embeds=embeds).logits
        loss = (logits.to(weights.dtype).log_softmax(-1) * weights).sum()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads, embeds.grad.clone()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_the_merged_product_is_peft_s_layer(dtype, tol, monkeypatch):
    model, vocab = _lora_model(dtype)
    layers = [m for m in model.modules() if isinstance(m, PeftLoraLinear)]
    assert layers and all(isinstance(m, MergedLoraLinear) and _fast_path(m) for m in layers)
    ids = torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 11, vocab, generator=torch.Generator().manual_seed(2), dtype=dtype)

    ours = _loss_and_grads(model, ids, weights, peft_forward=False, monkeypatch=monkeypatch)
    peft = _loss_and_grads(model, ids, weights, peft_forward=True, monkeypatch=monkeypatch)
    assert len(ours[1]) == 2 * len(layers)  # A and B of every layer, nothing else trains

    def rel(x, y):
        return float((x - y).abs().max() / y.abs().max())

    assert rel(ours[0], peft[0]) < tol  # logits
    assert rel(ours[2], peft[2]) < tol  # the input's gradient goes through the merged weight
    for name in peft[1]:
        assert rel(ours[1][name], peft[1][name]) < tol, name
        assert float(peft[1][name].abs().max()) > 0, name


def test_under_bf16_autocast_the_merged_product_trains_as_peft_s_layer(monkeypatch):
    """The update's mixed precision (float32 adapters, products in bf16 under torch.autocast): the backward runs
    outside autocast, so it must cast as the forward did (it raised "expected m1 and m2 to have the same dtype"
    before); the gradients are float32, as the adapters, and agree with peft's within bf16 rounding."""
    model, vocab = _lora_model(torch.float32)
    ids = torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 11, vocab, generator=torch.Generator().manual_seed(2))
    ours = _loss_and_grads(model, ids, weights, peft_forward=False, monkeypatch=monkeypatch, autocast=torch.bfloat16)
    peft = _loss_and_grads(model, ids, weights, peft_forward=True, monkeypatch=monkeypatch, autocast=torch.bfloat16)
    assert ours[2].dtype == torch.float32
    for name in peft[1]:
        assert ours[1][name].dtype == torch.float32, name
        cos = torch.nn.functional.cosine_similarity(ours[1][name].flatten(), peft[1][name].flatten(), dim=0)
        assert float(cos) > 0.99, name


def test_the_fast_path_is_what_runs_and_the_engine_gets_its_weights():
    model, _ = _lora_model(torch.float32)
    layer = next(m for m in model.modules() if isinstance(m, MergedLoraLinear))
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    assert type(layer(x).grad_fn).__name__ == "_MergedLoraBackward"
    merged = merged_state_dict(model)
    name = next(n for n, m in model.named_modules() if m is layer)
    assert torch.equal(merged[f"{name}.weight"], merged_weight(layer))  # bit for bit what the trainer uses


def test_a_layer_off_the_fast_path_runs_peft_s_forward():
    model, _ = _lora_model(torch.float32)
    layer = next(m for m in model.modules() if isinstance(m, MergedLoraLinear))
    layer.get_base_layer().weight.requires_grad_(True)  # a trained base is not the merged product's case
    assert not _fast_path(layer)
    x = torch.randn(2, 5, layer.in_features)
    assert "_MergedLora" not in type(layer(x).grad_fn).__name__
