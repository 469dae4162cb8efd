"""A loaded model as the callables the accuracy measurements take, run through the chosen KV cache.

Every forward goes through a fresh ``KVCache`` of the requested ``kv_dtype``, because that is what the
engine attends over: with "int8" or "fp8" the keys and values are quantized on write and dequantized
for attention, so perplexity, KL and task accuracy include the cache's error. "bf16" runs without a
cache (the cache would store the keys and values unchanged).

The lm_head is the largest matmul of a small model with a big vocabulary (Gemma 3 270M: 262144 x 640,
more FLOPs per token than all 18 blocks together), and the measurements need logits at a few positions
only, so both callables apply it only where logits are read.
"""

from collections.abc import Callable

import torch

from qinfer.model.kv_cache import make_cache
from qinfer.model.decoder import Transformer

BASELINE_KV = "bf16"  # the reference model is measured without a quantized cache


def eval_device() -> str:
    """Where the eval runs its models: the GPU if there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# (ids [T], first) -> logits [T - first, V]: the logits at positions first..T-1 of one sequence
LogitsFn = Callable[[torch.Tensor, int], torch.Tensor]


def _hidden(model: Transformer, ids: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    # ids: [B, T] -> final-norm hidden states [B, T, C]
    B, T = ids.shape
    cache = None if kv_dtype == "bf16" else make_cache(model, B, T, kv_dtype)
    return model.hidden_states(ids, torch.arange(T, device=ids.device), cache)


def window_logits(model: Transformer, kv_dtype: str, bos_id: int | None) -> LogitsFn:
    """Logits of one window of running text, with ``bos_id`` put in front of it unless None.

    Pass the tokenizer's ``leading_bos``: the BOS it starts text with, as llama.cpp's perplexity does. A
    window cut from the middle of a text has none, and models trained to always see one at position 0
    (Gemma) treat whatever token sits there as a sink: Gemma 3 270M's perplexity on Persuasion is far
    higher without it (docs/results.md, "Figures formerly in code comments"). The BOS is context only
    (position 0; the window's tokens follow at 1..T), never scored.
    Models whose tokenizer adds no BOS (SmolLM2, Qwen) never saw one before text, so none is put there.
    """

    @torch.no_grad()
    def logits(ids: torch.Tensor, first: int) -> torch.Tensor:
        ids = ids.to(model.device)
        lead = 0 if bos_id is None else 1
        if lead:
            ids = torch.cat([torch.tensor([bos_id], device=ids.device), ids])
        h = _hidden(model, ids[None], kv_dtype)[0, first + lead :]  # [T - first, C]
        return model.lm_head(h)

    return logits


class LazyLogits:
    """Hidden states of a batch that turn into logits when indexed as ``[b, positions]``.

    It stands in for the ``[B, T, V]`` logits tensor ``qinfer.evals.tasks.continuation_loglik`` expects:
    that function reads ``logits[b, n_context - 1 : len(row) - 1]``, the continuation's positions, so the
    lm_head runs on those rows only, and the ``[B, T, V]`` tensor (hundreds of MB for a long context and
    a 262144-token vocabulary) never exists. Any other use fails loudly rather than silently.
    """

    def __init__(self, model: Transformer, hidden: torch.Tensor):
        self._model, self._hidden = model, hidden  # hidden: [B, T, C]
        self.shape = (*hidden.shape[:2], model.config.vocab_size)

    def __getitem__(self, index) -> torch.Tensor:
        if not (isinstance(index, tuple) and len(index) == 2 and isinstance(index[0], int)):
            raise TypeError(f"LazyLogits supports [b, positions] indexing only, not {index!r}")
        return self._model.lm_head(self._hidden[index])

    def select(self, spans: list[tuple[int, slice]]) -> list[torch.Tensor]:
        """``[self[b, s] for b, s in spans]`` through one lm_head call: each call streams the whole lm_head
        (335 MB for Gemma 3 270M) however few rows it multiplies."""
        rows = [self._hidden[b, s] for b, s in spans]
        logits = self._model.lm_head(torch.cat(rows))
        return list(logits.split([len(r) for r in rows]))


def batch_forward(model: Transformer, kv_dtype: str) -> Callable[[torch.Tensor], LazyLogits]:
    """``forward(ids [B, T]) -> logits [B, T, V]`` (as a :class:`LazyLogits`) for ``continuation_loglik``."""

    @torch.no_grad()
    def forward(ids: torch.Tensor) -> LazyLogits:
        return LazyLogits(model, _hidden(model, ids.to(model.device), kv_dtype))

    return forward
