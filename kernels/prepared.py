"""A kernel's own layout of a weight, built once per weight rather than on every call."""

import weakref
from collections.abc import Callable


def per_weight(store: dict, weight, build: Callable):
    """``store[id(weight)]``, built by ``build(weight)`` on first use and dropped when the weight is freed:
    a kernel's layout of a packed weight, converted once per weight rather than on every call."""
    key = id(weight)
    if key not in store:
        store[key] = build(weight)
        weakref.finalize(weight, store.pop, key, None)
    return store[key]
