"""What a request asks of sampling, and sampling itself: greedy, or temperature, top-k and top-p."""

from dataclasses import dataclass

import torch

from qinfer.errors import check_seed, QinferError
from qinfer.kernels import decode_cpu


class ContextFull(QinferError):
    """A prompt and its --max-tokens past the model's context (a chat turn: the conversation has grown too long)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first that appears
    stop_ids: tuple[int, ...] = ()  # stop token ids, beside the tokenizer's end-of-sequence ids

    def __post_init__(self):
        if self.max_tokens < 1:
            raise QinferError(f"--max-tokens must be at least 1 (got {self.max_tokens})")
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise QinferError(f"--temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise QinferError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise QinferError(f"--top-k must be >= 0 (got {self.top_k})")
        check_seed(self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise QinferError(f"stop strings must be non-empty strings (got {list(self.stop)!r})")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] logits -> [B] ids of each row's largest logit (the first of a tie, a NaN's if any), as ``argmax``
    gives them. On CPU through ``decode_cpu.argmax``'s C pass; else through ``torch.max``, whose CPU kernel reads a
    vocabulary row faster than argmax's (gemma3's 262144 bf16 logits: docs/results.md, "Figures formerly in code
    comments")."""
    if decode_cpu.argmax_supported(logits):
        return decode_cpu.argmax(logits)
    return torch.max(logits, dim=-1).indices


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    # logits: [B, V] -> token ids [B]
    if params.temperature < 1e-45:  # 0, or a temperature fp32 holds as 0 (under its least subnormal)
        return greedy(logits)
    # Less the row's largest first: a tiny temperature (1e-40) then sends the others to -inf, not inf/NaN.
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
