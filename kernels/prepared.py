"""A kernel's own layout of a weight, built once per weight rather than on every call."""

import weakref
from collections.abc import Callable

import torch

from qinfer.format import unpack


def per_weight(store: dict, weight, build: Callable):
    """``store[id(weight)]``, built by ``build(weight)`` on first use and dropped when the weight is freed:
    a kernel's layout of a packed weight, converted once per weight rather than on every call."""
    key = id(weight)
    if key not in store:
        store[key] = build(weight)
        weakref.finalize(weight, store.pop, key, None)
    return store[key]


def zero_groups(qweight: torch.Tensor, zero: torch.Tensor | None, bits: int, G: int) -> torch.Tensor:
    """``[N, K/G]``: True for each group whose codes all equal its zero point (``2^(bits-1)`` where ``zero`` is
    None), a group of zero weights. A kernel that sums ``q x`` and ``z x`` apart leaves a residue there, which
    the group's scale multiplies (AutoGPTQ gives such groups 2 / (2^b - 1); older qinfer models gave them 1):
    the kernels make those groups exactly 0, as the weights say."""
    N, ng = qweight.shape[0], qweight.shape[1] * 8 // bits // G
    z = (torch.full((N, ng), 1 << (bits - 1), dtype=torch.uint8) if zero is None else zero).to(torch.int16)
    if bits in (4, 8):  # on the packed bytes: a 4-bit group of zeros is G / 2 bytes of z + 16 z
        stored = qweight.reshape(N, ng, G * bits // 8)
        return (stored == (z * 17 if bits == 4 else z)[..., None].to(torch.uint8)).all(-1)
    return (unpack(qweight, bits, ng * G).view(N, ng, G) == z[..., None]).all(-1)
