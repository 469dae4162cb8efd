"""The linear entry point: ``y = x @ W^T + b`` for whatever form ``W`` is stored in.

A dense tensor goes to ``torch.nn.functional.linear``. A packed weight registers its kernel with
``register`` (keyed by the weight's type), so new formats plug in without touching the model.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

_KERNELS: dict[type, Callable] = {}


def register(weight_type: type, kernel: Callable) -> None:
    """Route ``linear(x, w, b)`` for ``isinstance(w, weight_type)`` to ``kernel(x, w, b)``."""
    _KERNELS[weight_type] = kernel


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [..., K]; weight: [N, K] dense or packed; returns [..., N] in x's dtype
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    for cls in type(weight).__mro__:
        if cls in _KERNELS:
            return _KERNELS[cls](x, weight, bias)
    raise TypeError(f"no linear kernel registered for weights of type {type(weight).__name__}")
