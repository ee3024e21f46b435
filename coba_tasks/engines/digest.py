"""A digest of a policy's trained parameters, computed where they are (the GPU, or the CPU), for the replay check
(docs/design.md, "Checkpoints and replay": every update records it; a replayed update is accepted only when its
digest is the same).

Every bit of every element counts. Each tensor's bits are read as 32-bit integers, cut into blocks of ``BLOCK``
and summed with four sets of position weights below 2^12 in one float64 matrix product: every partial sum is an
integer below 2^53, so the product is exact whatever order the device's kernel adds in (a sum of the floats
themselves would not be). The block sums are then weighted per block modulo the prime 2^31 - 1. A change of one
ulp in one element changes all four sums; changes that cancel in all four are left to chance (about 2^-48 for
two). The sums of each tensor, its name, shape and dtype go through sha256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

PRIME = 2**31 - 1
BLOCK = 1024  # |bits| < 2^31, weights < 2^12: a block's sum stays below 2^53, exact in float64
WEIGHTINGS = 4
CHUNK = 16384 * BLOCK  # elements per pass: bounds the float64 temporary at 128 MiB
SEED = 0x5EED

_WEIGHTS: dict[str, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """The (``BLOCK``, ``WEIGHTINGS``) position weights, each in [1, 2^12), as float64 on ``device``; made once."""
    key = str(device)
    if key not in _WEIGHTS:
        gen = torch.Generator().manual_seed(SEED)
        w = torch.randint(1, 1 << 12, (BLOCK, WEIGHTINGS), generator=gen, dtype=torch.int64)
        _WEIGHTS[key] = w.to(device=device, dtype=torch.float64)
    return _WEIGHTS[key]


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat int32 tensor (elements of 1 or 2 bytes widened one by one; 8 bytes: two each)."""
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    if size in (4, 8):
        return flat.view(torch.int32)
    return flat.view({1: torch.uint8, 2: torch.int16}[size]).to(torch.int32)


def tensor_sums(t: torch.Tensor) -> list[int]:
    """The ``WEIGHTINGS`` position-weighted sums of ``t``'s bits, modulo ``PRIME``."""
    bits = _as_int32(t)
    n, device = bits.numel(), bits.device
    w = _weights(device)
    total = torch.zeros(WEIGHTINGS, dtype=torch.int64, device=device)
    # one buffer for every pass: a fresh 128 MiB tensor per pass costs more in page faults than the product
    buffer = torch.zeros(min(CHUNK, n + (-n) % BLOCK), dtype=torch.float64, device=device)
    for start in range(0, n, CHUNK):
        part = bits[start : start + CHUNK]
        size = part.numel() + (-part.numel()) % BLOCK
        buffer[: part.numel()].copy_(part)
        buffer[part.numel() : size].zero_()  # the last block's tail
        rows = buffer[:size].view(-1, BLOCK)
        sums = (rows @ w).to(torch.int64).remainder(PRIME)  # exact integers, each below 2^31 after the modulo
        index = torch.arange(rows.shape[0], device=device, dtype=torch.int64) + start // BLOCK
        block_w = (index * 1_000_003 + SEED).remainder(PRIME).unsqueeze(1)  # below 2^31
        total = (total + (sums * block_w).remainder(PRIME).sum(dim=0)).remainder(PRIME)
    return [int(x) for x in total.tolist()]


def params_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """16 hex digits over every ``(name, tensor)`` in the order given: its name, dtype, shape and bits."""
    h = hashlib.sha256()
    for name, t in named:
        sums = ",".join(str(s) for s in tensor_sums(t))
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{sums};".encode())
    return h.hexdigest()[:16]
