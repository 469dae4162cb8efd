"""The serving engine: many requests at once over one paged KV cache, one step at a time.

``Engine.add`` queues a request (prompt ids and its sampling settings); each ``Engine.step`` asks the
:class:`~qinfer.engine.scheduler.Scheduler` which tokens run, runs them, samples a token for each request that
is due one, and returns what each request produced (:class:`Output`: new token ids, new text, and once it ends,
why, its token counts and timings). ``Engine.abort`` ends a request early. ``generate``, ``chat`` and ``serve``
are clients of it.

A step is one forward over every decoding request's newest token (``Transformer.decode_rows``: each linear
reads its weights once for all of them, which is what a decode step is bound by), plus one forward per prompt
chunk the step runs (a prompt chunk is compute-bound: reading the weights once more costs little beside its
FLOPs, and the chunk is computed exactly as it would be alone). Then the language-model head runs on the rows
that sample, together. So a request's logits do not depend on what else runs, where the linear kernels sum each
row on its own (the CPU's C kernels do), and a request with a seed (its own generator) gives the same tokens
whatever else is running; a greedy one the same as alone.

Sampling is ``qinfer.engine.generate``'s: temperature, top-p, top-k and a seed per request. A request ends at
``max_tokens``, at a stop id (the tokenizer's end-of-sequence ids, and the request's own; not part of the
output), or at a stop string (the text ends before it; text that could begin a stop string is held back until
it cannot).
"""

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from qinfer.engine.sampling import ContextFull, SamplingParams, greedy, sample
from qinfer.engine.scheduler import Request, Scheduler
from qinfer.errors import QinferError
from qinfer.model.decoder import Transformer
from qinfer.model.kv_cache import BLOCK_SIZE, DecodeRows, KVCache, KV_DTYPES, make_cache
from qinfer.sources.tokenizer import StreamDecoder, Tokenizer


def check_fits(model: Transformer, prompt_ids: Sequence[int], max_tokens: int) -> None:
    """Refuse an empty prompt, and a prompt whose ``max_tokens`` would run past the model's context
    (:class:`ContextFull`)."""
    if not prompt_ids:
        raise QinferError("the prompt is empty after tokenization")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + max_tokens > limit:
        raise ContextFull(f"prompt ({len(prompt_ids)} tokens) + max tokens ({max_tokens}) exceeds the model's "
                          f"context of {limit} tokens: shorten the prompt or lower the max tokens")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine spends memory and each step (see ``qinfer.engine.scheduler``)."""

    kv_dtype: str = "bf16"  # "bf16", "int8" or "fp8" (int8/fp8 use the scales `quantize --kv-cache` stored)
    kv_memory: int = 1 << 30  # bytes of KV-cache blocks
    block_size: int = BLOCK_SIZE
    max_step_tokens: int = 512
    max_running: int = 64
    prefill_chunk: int = 256
    prefix_caching: bool = True


@dataclass
class Timings:
    """When a request arrived, and when each of its tokens came out (``time.perf_counter`` seconds)."""

    arrival: float
    tokens: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token."""
        return self.tokens[0] - self.arrival if self.tokens else None

    @property
    def tpot(self) -> float | None:
        """Mean seconds per token after the first."""
        return (self.tokens[-1] - self.tokens[0]) / (len(self.tokens) - 1) if len(self.tokens) > 1 else None


@dataclass
class Output:
    """What one step produced for one request: its new tokens and text, and whether (and why) it ended."""

    id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # None while running; "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache
    timings: Timings

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Live:
    """The engine's state of one request beyond the scheduler's: sampling, stop conditions, text, timings."""

    def __init__(self, request: Request, params: SamplingParams, stop_ids: frozenset[int],
                 decoder: StreamDecoder | None, device):
        self.request, self.params, self.stop_ids, self.decoder = request, params, stop_ids, decoder
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)
        self.text, self.sent = "", 0  # the text so far, and how much of it was returned
        self.hold = max((len(s) for s in params.stop), default=1) - 1  # chars that could begin a stop string
        self.timings = Timings(time.perf_counter())
        self.finish_reason: str | None = None
        self.stop_id = False  # ended by a stop id (which is not part of the output)
        self.new_ids: list[int] = []

    def take(self, token: int) -> None:
        """Record a sampled token: a stop id ends the request; else it joins the output and its text is checked
        for stop strings."""
        self.timings.tokens.append(time.perf_counter())
        if token in self.stop_ids:
            self.finish_reason, self.stop_id = "stop", True
            return
        self.new_ids.append(token)
        if self.decoder is None:
            return
        searched = max(0, len(self.text) - self.hold)
        self.text += self.decoder.feed(token)
        for stop in self.params.stop:
            found = self.text.find(stop, searched)
            if found >= 0:
                self.text, self.finish_reason = self.text[:found], "stop"
                searched = len(self.text)

    def output(self) -> Output:
        """What is new since the last output (text held back while it could begin a stop string)."""
        if self.decoder is not None and (self.finish_reason in ("length", "abort") or self.stop_id):
            self.text += self.decoder.flush()  # (a stop string's text ends before it: nothing held matters)
        end = len(self.text) if self.finish_reason is not None else max(self.sent, len(self.text) - self.hold)
        text, self.sent = self.text[self.sent:end], end
        ids, self.new_ids = self.new_ids, []
        r = self.request
        return Output(r.id, ids, text, self.finish_reason, len(r.prompt), len(r.generated), r.cached_tokens,
                      self.timings)


class Engine:
    """Continuous batching of requests on one model (see the module docstring)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, config: EngineConfig = EngineConfig(),
                 eos_ids: Iterable[int] | None = None):
        """``tokenizer`` gives text and stop strings (without it, outputs hold token ids only); ``eos_ids`` end
        every request (default: the tokenizer's)."""
        if config.kv_dtype not in KV_DTYPES:
            raise QinferError(f"unknown KV-cache dtype {config.kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        blocks = KVCache.blocks_for_memory(model.config, config.kv_memory, config.block_size, config.kv_dtype,
                                           model.dtype)
        self.cache = make_cache(model, 0, config.block_size, config.kv_dtype, config.block_size, blocks)
        self.scheduler = Scheduler(self.cache, config.max_step_tokens, config.max_running, config.prefill_chunk,
                                   config.prefix_caching)
        default_eos = tokenizer.eos_ids if tokenizer is not None else ()
        self.eos_ids = frozenset(default_eos if eos_ids is None else eos_ids)
        self.live: dict[str, _Live] = {}
        self.steps = self.preemptions = 0

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            context: Sequence[int] | None = None) -> None:
        """Queue a request. ``context``: ids its text continues (default: the prompt's last, so a continuation's
        first word keeps its leading space). Refused here, before any step: an empty prompt, a duplicate id, one
        past the model's context or too long for the whole KV cache."""
        if request_id in self.live:
            raise QinferError(f"a request with id {request_id!r} is already running")
        self.check(prompt_ids, params)
        request = Request(request_id, [int(i) for i in prompt_ids], params.max_tokens)
        self.scheduler.add(request)
        decoder = None
        if self.tokenizer is not None:
            decoder = StreamDecoder(self.tokenizer, context=prompt_ids[-1:] if context is None else context)
        self.live[request_id] = _Live(request, params, self.eos_ids | set(params.stop_ids), decoder,
                                      self.model.device)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Refuse a request :meth:`add` could not run (it reads no state that steps change, so another thread,
        a server's, may call it): an empty prompt, stop strings without a tokenizer, a prompt and its max tokens
        past the model's context (:class:`ContextFull`) or more than the whole KV cache holds."""
        check_fits(self.model, prompt_ids, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise QinferError("stop strings need the engine to have a tokenizer")
        self.scheduler.check(len(prompt_ids), params.max_tokens)

    @property
    def max_tokens_held(self) -> int:
        """The most positions one request can have: the model's context, or the whole KV cache if that is less."""
        return min(self.model.config.max_position_embeddings, self.cache.num_blocks * self.cache.block_size)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, request_id: str) -> Output | None:
        """End a request now (its blocks are freed); its last output, or None if it is not running."""
        live = self.live.pop(request_id, None)
        if live is None:
            return None
        self.scheduler.finish(live.request)
        live.finish_reason = "abort"
        return live.output()

    @torch.no_grad()
    def step(self) -> list[Output]:
        """Run one step; the outputs of the requests that produced a token or ended in it."""
        step = self.scheduler.schedule()
        self.steps += 1
        self.preemptions += len(step.preempted)
        hidden = self._forward(step)  # request id -> final hidden state [C] of its sampling row
        sampled = self._sample(hidden)
        for request_id, token in sampled.items():
            live = self.live[request_id]
            live.take(token)
            if live.finish_reason is not None:
                live.request.finished = True
        done = self.scheduler.advance(step, {i: t for i, t in sampled.items() if not self.live[i].stop_id})
        outputs = []
        for request_id in sampled:
            live = self.live[request_id]
            if live.request in done and live.finish_reason is None:
                live.finish_reason = "length"
            outputs.append(live.output())
            if live.finish_reason is not None:
                del self.live[request_id]
        return outputs

    def _forward(self, step) -> dict[str, torch.Tensor]:
        """Compute the step's tokens: prompt chunks one forward each, then all decode rows in one."""
        device, hidden = self.model.device, {}
        ids, tables, positions, sampling = [], [], [], []
        for s in step.scheduled:
            request, end = s.request, s.start + s.count
            tokens, prompt = request.tokens, len(request.prompt)
            if s.start < prompt:  # a prompt chunk (never past the prompt: the scheduler's grid)
                stop = min(end, prompt)
                self.cache.bind([request.table])
                h = self.model.hidden_states(torch.tensor([tokens[s.start:stop]], device=device),
                                             torch.arange(s.start, stop, device=device), self.cache,
                                             span=(s.start, stop - 1))
                if s.samples and stop == end:
                    hidden[request.id] = h[0, -1]
            for position in range(max(s.start, prompt), end):  # decode rows (generated tokens, recomputed too)
                ids.append(tokens[position])
                tables.append(request.table)
                positions.append(position)
                sampling.append(request.id if s.samples and position == end - 1 else None)
        if ids:
            h = self.model.decode_rows(torch.tensor(ids, device=device), DecodeRows(self.cache, tables, positions))
            hidden.update({request_id: h[i] for i, request_id in enumerate(sampling) if request_id is not None})
        return hidden

    def _sample(self, hidden: dict[str, torch.Tensor]) -> dict[str, int]:
        """One token per request in ``hidden``, by its own sampling settings."""
        if not hidden:
            return {}
        order = list(hidden)
        logits = self.model.lm_head(torch.stack([hidden[i] for i in order]))  # [S, V], one product for all
        tokens = {}
        greedy_rows = [n for n, i in enumerate(order) if self.live[i].params.temperature < 1e-45]
        if greedy_rows:
            chosen = logits if len(greedy_rows) == len(order) else logits[greedy_rows]  # (no copy when all are)
            for n, token in zip(greedy_rows, greedy(chosen).tolist()):
                tokens[order[n]] = token
        for n, request_id in enumerate(order):
            if request_id not in tokens:
                live = self.live[request_id]
                tokens[request_id] = int(sample(logits[n:n + 1], live.params, live.generator)[0])
        return {i: tokens[i] for i in order}

    def run(self, requests: Iterable[tuple[str, Sequence[int], SamplingParams]]) -> dict[str, list[Output]]:
        """Add ``requests`` (id, prompt ids, sampling) and step until all have ended: each one's outputs, in order."""
        outputs: dict[str, list[Output]] = {}
        for request_id, prompt, params in requests:
            self.add(request_id, prompt, params)
            outputs[request_id] = []
        while self.has_work():
            for out in self.step():
                outputs.setdefault(out.id, []).append(out)
        return outputs
