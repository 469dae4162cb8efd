"""Where a decode step's time goes: the ops of a few decode steps under ``torch.profiler``.

    python -m qinfer.evals.diagnostics.decode_profile MODEL [--prompt-tokens 512] [--steps 8] [--top 12] [--min-share 0.01]
        [--compile [--rounds 3]] [--layer-by-layer] [--against-layers [--rounds 3]]

The setting is ``qinfer eval``'s speed run (:mod:`qinfer.evals.speed`): a fixed pseudo-random prompt prefilled
into a bf16 KV cache, then greedy decode steps at batch 1. It prints the median step time without the profiler,
the op calls a step, the ops with the most self time per step under it (calls per step beside each), and apart
from them the ops on a vocabulary-wide tensor (over 1% of the time): the lm_head, most of a small model's
bytes, and the pick of the next token. Self times are the calling thread's wall time in each op (an op's own
worker threads are inside it), so the rows add up to at most the profiled step.

``--compile`` then also times ``torch.compile(decode_step, dynamic=True)`` (``compiled_decode_step``, which
``qinfer generate --compile`` and ``qinfer chat --compile`` decode through) against the eager step: the
compile's seconds and graphs, then both step times in alternating rounds from the same cache state, and
whether their greedy tokens agree.

A decode step whose layers the C call takes (``qinfer.model.decode_plan``) shows them as one op,
``qinfer::decode_layers``; ``--layer-by-layer`` profiles the layers run as modules instead (the eager path that
call replaces), and ``--against-layers`` then times the two steps in alternating rounds from the same cache state,
and says whether their greedy tokens agree.

Diagnostic only, CPU only: nothing is written, nothing cached (but inductor's own cache).
"""

import contextlib
import copy
import logging
import statistics
import time
from collections.abc import Callable

import click
import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.evals.roofline import threads_text
from qinfer.evals.speed import checked_prompt
from qinfer.engine.generate import compiled_decode_step, decode_step, prefill
from qinfer.engine.sampling import greedy
from qinfer.model.decode_plan import layer_by_layer
from qinfer.model.kv_cache import KVCache, make_cache
from qinfer.model.loader import load_model
from qinfer.sources.resolve import resolve_model

WARMUP_STEPS = 4


@click.command(cls=Command)
@click.argument("model")
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--steps", type=int, default=8, show_default=True, help="Decode steps timed, and then profiled.")
@click.option("--top", type=int, default=12, show_default=True, help="Ops listed, by self time.")
@click.option("--min-share", type=float, default=0.01, show_default=True,
              help="Vocabulary-wide ops taking less of the profiled time than this share (0..1) are left out.")
@click.option("--compile", "compiled", is_flag=True,
              help="Also time a torch.compile'd decode step against the eager one (minutes to compile).")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="With --compile or --against-layers: rounds of --steps each.")
@click.option("--layer-by-layer", "by_layer", is_flag=True,
              help="Profile the decode step with its layers run as modules, not in one C call.")
@click.option("--against-layers", "against", is_flag=True,
              help="Also time the one-call decode step against the layer-by-layer one.")
def main(model, prompt_tokens, steps, top, min_share, compiled, rounds, by_layer, against):
    if steps < 1 or top < 1 or prompt_tokens < 1 or rounds < 1:
        raise QinferError("--prompt-tokens, --steps, --top and --rounds must be at least 1")
    if not 0 <= min_share <= 1:
        raise QinferError(f"--min-share is a share of the profiled time, in 0..1; got {min_share}")
    with layer_by_layer() if by_layer else contextlib.nullcontext():
        _report(model, prompt_tokens, steps, top, min_share, rounds if compiled else 0, rounds if against else 0)


@torch.no_grad()
def _report(model_name: str, prompt_tokens: int, steps: int, top: int, min_share: float, rounds: int,
            layer_rounds: int = 0) -> None:
    model = load_model(resolve_model(model_name), run=True)
    # timed, profiled, then the compile and its rounds, or the rounds against the layers run as modules (each on
    # copies of one cache state)
    given = max(rounds, layer_rounds)
    n_steps = 2 * steps + (1 + given * steps if given else 0)
    check_context(model, prompt_tokens, n_steps, {"--steps": steps, **({"--rounds": given} if given else {})})
    token, pos, cache = warmed_up(model, prompt_tokens, n_steps)
    times = []
    for pos in range(pos, pos + steps):
        t0 = time.perf_counter()
        token = greedy(decode_step(model, token, pos, cache))
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for pos in range(pos + 1, pos + 1 + steps):
            token = greedy(decode_step(model, token, pos, cache))
        profiled = time.perf_counter() - t0
    ms = 1000 / steps  # a total in seconds -> milliseconds per step
    print(f"{model_name}: {statistics.median(times) * 1000:.1f} ms a decode step (median of {steps}; "
          f"{profiled * ms:.1f} under the profiler), {prompt_tokens}-token prompt, {threads_text(torch.get_num_threads())}")
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    print(f"{sum(e.count for e in events) / steps:.0f} op calls a step (the ops inside an op counted too)")
    print(f"{'ms/step':>8} {'calls/step':>11}  op")
    for e in events[:top]:
        print(f"{e.self_cpu_time_total / 1e6 * ms:8.2f} {e.count / steps:11.0f}  {e.key}")
    rest = sum(e.self_cpu_time_total for e in events[top:])
    print(f"{rest / 1e6 * ms:8.2f} {sum(e.count for e in events[top:]) / steps:11.0f}  (all other ops)")
    vocab, floor = model.config.vocab_size, min_share * profiled * 1e6
    for e in prof.key_averages(group_by_input_shape=True):
        wide = any(vocab in shape for shape in e.input_shapes if isinstance(shape, list))
        if wide and e.self_cpu_time_total >= floor:
            print(f"vocabulary-wide: {e.self_cpu_time_total / 1e6 * ms:.2f} ms/step in {e.key} on {e.input_shapes}")
    if rounds:
        _compare_compiled(model, token, pos + 1, cache, steps, rounds)
    if layer_rounds:  # (from the same state: the rounds above ran on copies of the cache)
        _compare_layers(model, token, pos + 1, cache, steps, layer_rounds)


def _compare_layers(model, token: torch.Tensor, pos: int, cache, steps: int, rounds: int) -> None:
    """The decode step with its layers in one C call against the one running them as modules."""
    paths = {"one call": (decode_step, contextlib.nullcontext), "layer by layer": (decode_step, layer_by_layer)}
    times, agree = alternating_rounds(model, token, pos, cache, steps, rounds, paths)
    fast, eager = (statistics.median(times[k]) * 1000 for k in paths)
    print(f"layers in one C call: {fast:.2f} ms a step against {eager:.2f} layer by layer ({eager / fast:.2f}x; "
          f"medians of {rounds * steps} steps each, alternating rounds); greedy tokens "
          f"{'the same' if agree else 'differ'}")


def _compare_compiled(model, token: torch.Tensor, pos: int, cache, steps: int, rounds: int) -> None:
    """The compiled decode step against the eager one, in :func:`alternating_rounds`."""
    step = compiled_decode_step()
    counters.clear()
    breaks_log = logging.getLogger("torch._dynamo.variables.tensor")  # a warning per graph break: counted below
    level, breaks_log.level = breaks_log.level, logging.ERROR
    try:
        t0 = time.perf_counter()
        token = greedy(step(model, token, pos, cache))  # the compile, on the real cache
        compile_s = time.perf_counter() - t0
    finally:
        breaks_log.setLevel(level)
    reasons = sorted({reason.splitlines()[0] for reason in counters["graph_break"]})
    paths = {"eager": (decode_step, contextlib.nullcontext), "compiled": (step, contextlib.nullcontext)}
    times, agree = alternating_rounds(model, token, pos + 1, cache, steps, rounds, paths)
    eager, compiled = (statistics.median(times[k]) * 1000 for k in ("eager", "compiled"))
    print(f"torch.compile(decode_step, dynamic=True): {counters['stats']['unique_graphs']} graphs, "
          f"{sum(counters['graph_break'].values())} graph breaks" + (f" ({'; '.join(reasons)})" if reasons else ""))
    print(f"torch.compile(decode_step, dynamic=True): {compile_s:.0f} s to compile (the first step); then "
          f"{compiled:.1f} ms a step against {eager:.1f} eager ({eager / compiled:.2f}x; medians of "
          f"{rounds * steps} steps each, alternating rounds); greedy tokens {'the same' if agree else 'differ'}")


def check_context(model, prompt_tokens: int, n_steps: int, options: dict[str, int]) -> None:
    """Refuse, before any work, a ``--prompt-tokens`` that leaves no room in ``model``'s context for the ``n_steps``
    decode steps that ``options`` (the user's, e.g. {"--steps": 8}) ask for after :func:`warmed_up`'s warm-up."""
    limit, after = model.config.max_position_embeddings, WARMUP_STEPS + n_steps
    if prompt_tokens + after > limit:
        given = ", ".join(f"{name} {value}" for name, value in options.items())
        fix = f"use --prompt-tokens {limit - after} or fewer" if after < limit else f"lower {' or '.join(options)}"
        raise QinferError(f"--prompt-tokens {prompt_tokens} with {given} runs past the model's context of {limit} "
                          f"tokens ({after} decode steps follow the prompt, {WARMUP_STEPS} of them warm-up): {fix}")


def warmed_up(model, prompt_tokens: int, n_steps: int) -> tuple[torch.Tensor, int, KVCache]:
    """``qinfer eval``'s speed setting, warmed up: its fixed prompt prefilled into a bf16 KV cache with room for
    ``n_steps`` more steps after ``WARMUP_STEPS`` greedy ones, and a spare position (a compiled step whose keys
    fill the whole cache would be another graph). Returns the next token, its position and the cache."""
    prompt = checked_prompt(model, prompt_tokens, WARMUP_STEPS + n_steps)
    cache = make_cache(model, 1, prompt.shape[1] + WARMUP_STEPS + n_steps + 1, "bf16")
    token = greedy(prefill(model, prompt, cache))
    pos = prompt.shape[1]
    for pos in range(pos, pos + WARMUP_STEPS):
        token = greedy(decode_step(model, token, pos, cache))
    return token, pos + 1, cache


def alternating_rounds(model, token: torch.Tensor, pos: int, cache: KVCache, steps: int, rounds: int,
                       paths: dict[str, tuple[Callable, Callable]]):
    """Greedy decode steps along each of ``paths`` (name -> (step function, context manager factory to run it
    in)), ``steps`` a path per round from copies of one cache state, alternating which path goes first, so a
    machine that slows down for a while slows them all; each round goes on from the last path's state.
    Returns each path's step times (s) and whether their greedy tokens agreed throughout."""
    names = list(paths)
    times: dict[str, list[float]] = {name: [] for name in names}
    agree = True
    for r in range(rounds):
        tokens = {}
        for name in names if r % 2 == 0 else names[::-1]:
            step, context = paths[name]
            state, tok, tokens[name] = copy.deepcopy(cache), token, []
            with context():
                for p in range(pos, pos + steps):
                    t0 = time.perf_counter()
                    tok = greedy(step(model, tok, p, state))
                    times[name].append(time.perf_counter() - t0)
                    tokens[name].append(tok)
        agree &= all(all(torch.equal(a, b) for a, b in zip(tokens[names[0]], tokens[n])) for n in names[1:])
        token, cache, pos = tok, state, pos + steps
    return times, agree


if __name__ == "__main__":
    main()
