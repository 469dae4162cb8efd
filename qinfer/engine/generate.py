"""Generation of one request: on the engine, or (``compiled``) ``prefill`` the prompt, then a compiled
``decode_step`` one token at a time, sampling as configured."""

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from qinfer.engine.sampling import SamplingParams, sample
from qinfer.engine.engine import Engine, EngineConfig, check_fits
from qinfer.model.kv_cache import BLOCK_SIZE, KVCache, make_cache
from qinfer.model.decoder import Transformer


# Prompt positions per prefill forward: longer prompts run in chunks (at 32768 tokens a single forward's two
# [T, T] masks were 1 GiB each); 4096 keeps every prompt the evals time in one forward.
PREFILL_CHUNK = 4096


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache held (not computed)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # the steps in decode_seconds: one per token after prefill's, and one more for a stop id
    compile_seconds: float = 0.0  # the decode steps that compiled (with ``compiled``): not in decode_seconds
    compile_steps: int = 0

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens computed (not cached) per second."""
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of prefill; decode speed counts the steps timed after it (a compiling one
        # apart), including the step whose token was a stop id, which is timed but not yielded.
        return self.decode_steps / self.decode_seconds if self.decode_seconds and self.decode_steps else 0.0

    def summary(self) -> str:
        compiled = f", compiling the decode step {self.compile_seconds:.0f} s" if self.compile_steps else ""
        rate = f"at {self.decode_tps:.1f} tok/s" if self.decode_tps else "(no decode step after prefill's to time)"
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        prefill = f"prefill {self.prompt_tokens} tok{cached} at {self.prefill_tps:.1f} tok/s"
        return f"{prefill}, decode {self.generated_tokens} tok {rate}{compiled}"


@torch.no_grad()
def prefill(model: Transformer, ids: torch.Tensor, cache: KVCache, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    # ids: [B, T] -> last-position logits [B, V]. Runs ``chunk`` positions per forward, each against the
    # keys cached before it, so a long prompt's masks and activations are [chunk, ...], not [T, ...].
    T = ids.shape[1]
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        logits = model(ids[:, start:end], torch.arange(start, end, device=ids.device), cache, last_only=True)
    return logits[:, -1]


@torch.no_grad()
def decode_step(model: Transformer, token: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
    # token: [B] at position pos -> logits [B, V]
    return model(token[:, None], torch.tensor([pos], device=token.device), cache, span=(pos, pos))[:, -1]


@functools.cache
def compiled_decode_step() -> Callable:
    """``decode_step`` through ``torch.compile`` (inductor, dynamic shapes: one compile serves every position,
    cache length and prompt, with two exceptions: a step whose keys fill the whole cache is another graph, so
    callers keep a spare position; and a graph inductor read from its on-disk cache guards which side of a
    sliding window the position lies on, so a sequence passing the window compiles once more. Another model
    compiles again). The first step pays for the compile; then it runs more decode steps a second than the eager
    step on gemma3-270m and its 4-bit and FP8 models, as it removes the step's small ops (``qinfer eval MODEL
    --compile`` times both; the ratios, and how they shrank once the eager step's products, norms and attention
    ran in C, are in docs/results.md, "Speed against the roofline" and "Figures formerly in code comments";
    ``python -m qinfer.evals.diagnostics.decode_profile MODEL --compile`` times one model). Inductor's fused
    code sums in another order than the eager kernels: the logits differ in their last bits, and a greedy
    continuation can part from the eager one at a near-tie. Inductor compiles C++ with the machine's compiler."""
    return torch.compile(decode_step, dynamic=True)


def compiled_graphs() -> int:
    """The graphs torch.compile has built in this process. Imports torch._dynamo, whose import costs memory
    and time (docs/results.md, "Figures formerly in code comments"): only for callers that compile."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


_COMPILE_ERRORS: list[str] = []  # why compiling the decode step failed in this process: not tried again


def compile_error() -> str:
    """Why compiling the decode step failed in this process ("" if it has not); decoding went on eagerly."""
    return _COMPILE_ERRORS[0] if _COMPILE_ERRORS else ""


def compile_failure_reason(error: Exception) -> str:
    """A failed compile's exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def compile_failure_note() -> str:
    """The one line ``generate`` and ``chat`` print when ``--compile`` failed ("" when it has not)."""
    return f"note: --compile failed ({compile_error()}); decoded without it" if _COMPILE_ERRORS else ""


def _step_logits(compiled: bool, model, token, pos, cache) -> torch.Tensor:
    """A decode step's logits, through the compiled step when ``compiled`` (and compiling has not failed)."""
    if not compiled or _COMPILE_ERRORS:
        return decode_step(model, token, pos, cache)
    try:
        return compiled_decode_step()(model, token, pos, cache)
    except Exception as e:  # no C++ compiler, an op inductor cannot lower, ...: decode eagerly from now on
        _COMPILE_ERRORS.append(compile_failure_reason(e))
        return decode_step(model, token, pos, cache)  # rewrites the same cache positions


def generate(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    stop_ids: tuple[int, ...] = (),
    stats: GenerationStats | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    compiled: bool = False,
    kv_dtype: str = "bf16",
    engine: Engine | None = None,
) -> Iterator[int]:
    """Generated token ids one by one (stop ids are not yielded), attending over a KV cache of ``kv_dtype``
    (qinfer.model.kv_cache: "int8" and "fp8" use the scales ``qinfer quantize --kv-cache`` stored, if any): one
    request on ``engine`` (``qinfer.engine.engine``; default: a new one with a KV cache the size of the request,
    of ``kv_dtype``; a chat keeps one, so each turn reuses the cached conversation before it). ``compiled``:
    instead, one sequence's ``prefill`` and then :func:`compiled_decode_step` from the second step on (the first,
    eager, builds the kernels' weight layouts, which must not be made inside a traced step). A request that cannot
    run (an empty prompt, or one too long for the model's context) is refused here, before any token: the caller
    has written nothing yet."""
    check_fits(model, prompt_ids, params.max_tokens)
    stats = stats if stats is not None else GenerationStats()
    if not compiled:
        if engine is None:
            engine = Engine(model, config=EngineConfig(kv_dtype=kv_dtype, kv_memory=kv_memory_for(
                model, len(prompt_ids) + params.max_tokens, kv_dtype)), eos_ids=())
        request_id = f"generate-{next(_REQUESTS)}"
        engine.add(request_id, prompt_ids, replace(params, stop_ids=tuple(params.stop_ids) + tuple(stop_ids)))
        return _engine_tokens(engine, request_id, stats, should_stop)
    cache = make_cache(model, 1, len(prompt_ids) + params.max_tokens, kv_dtype)
    return _tokens(model, prompt_ids, params, stop_ids, stats, should_stop, compiled, cache)


_REQUESTS = itertools.count()


def kv_memory_for(model: Transformer, positions: int, kv_dtype: str = "bf16") -> int:
    """Bytes of KV-cache blocks that hold ``positions`` positions of ``model``."""
    return KVCache.bytes_per_block(model.config, BLOCK_SIZE, kv_dtype, model.dtype) * -(-positions // BLOCK_SIZE)


def _engine_tokens(engine: Engine, request_id: str, stats: GenerationStats,
                   should_stop: Callable[[], bool]) -> Iterator[int]:
    stats.prompt_tokens = len(engine.live[request_id].request.prompt)
    start = time.perf_counter()
    try:
        while engine.has_work():
            for out in engine.step():
                if out.id != request_id:
                    continue
                times = out.timings.tokens
                stats.cached_tokens = out.cached_tokens
                stats.prefill_seconds = times[0] - start
                stats.decode_seconds, stats.decode_steps = times[-1] - times[0], len(times) - 1
                for token in out.token_ids:
                    stats.generated_tokens += 1
                    yield token
                if out.finished:
                    return
                if should_stop():
                    engine.abort(request_id)
                    return
    finally:  # also when the caller stops reading: the request's blocks go back
        engine.abort(request_id)


def _tokens(model, prompt_ids, params, stop_ids, stats, should_stop, compiled, cache) -> Iterator[int]:
    max_len = len(prompt_ids) + params.max_tokens
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(params.seed)
    # the last step writes position max_len - 2: a spare position, so no step's keys fill the cache (one graph)
    ids = torch.tensor([prompt_ids], device=model.device)
    stats.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    token = sample(prefill(model, ids, cache), params, generator)
    stats.prefill_seconds = time.perf_counter() - t0
    for pos in range(len(prompt_ids), max_len):
        tok = int(token[0])
        if tok in stop_ids:
            break
        stats.generated_tokens += 1
        yield tok
        if pos == max_len - 1 or should_stop():
            break
        compiling = compiled and pos > len(prompt_ids)  # the first step stays eager (see the docstring)
        graphs, errors = compiled_graphs() if compiling else 0, len(_COMPILE_ERRORS)
        t0 = time.perf_counter()
        token = sample(_step_logits(compiling, model, token, pos, cache), params, generator)
        if compiling and (compiled_graphs() > graphs or len(_COMPILE_ERRORS) > errors):
            stats.compile_seconds += time.perf_counter() - t0
            stats.compile_steps += 1
        else:
            stats.decode_seconds += time.perf_counter() - t0
            stats.decode_steps += 1
