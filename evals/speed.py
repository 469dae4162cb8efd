"""Speed at batch 1: prefill of a fixed-length prompt, then greedy decode steps, with MBU and MFU.

One run: a fresh KV cache of the chosen dtype, ``prefill`` of ``prompt_tokens`` token ids (TTFT is the
prefill plus picking the first token), then ``decode_steps`` calls of ``decode_step`` each picking its
token by ``greedy`` (argmax). TPOT is the run's mean time per decode step. Each figure reported is the median over
``repeats`` runs, after one short warm-up run that pages the weights in and starts the thread pool.

Several models (:func:`measure_speeds`) are measured in rounds, each round one run of every model in turn,
not all of one model's runs and then the next's: a shared machine that slows down for a minute then slows
every model alike, and their ratios are measured side by side.

Utilisation against the measured roofline (:mod:`qinfer.evals.roofline`):

    MBU = decode_bytes / TPOT / read bandwidth      bytes per step from qinfer.evals.costs, at the mean
                                                    context of the decode steps
    MFU = sum over dtypes of prefill FLOPs in that dtype / its peak, over the prefill time: the share of
          the measured ceilings the prefill reaches, each FLOP held to the peak of the dtype it multiplies
          in (qinfer.evals.costs.prefill_flops_by_dtype: the CPU int4 kernel, which takes prompts shorter
          than qinfer.kernels.int4_cpu.max_rows, 32 tokens where the CPU has native bf16 GEMMs and 128
          where the GEMMs run in fp32, multiplies in fp32 even in a bf16 model, so such a 4-bit prefill is
          held to the fp32 peak; longer ones, and a bf16 model's, to the peak of the dtype their GEMMs run
          in: bf16, or fp32 on a CPU without native bf16 GEMMs)

With ``compiled`` the decode steps are also timed through :func:`qinfer.engine.generate.compiled_decode_step`
(``torch.compile``, what ``qinfer generate --compile`` decodes with): after the eager warm-up, one compiled
warm-up run per model at the timed positions compiles it (``compile_s``: its wall time; a graph compiled for
other positions can be another graph, e.g. inside a sliding window and past it), and every run then decodes its
steps twice from the same prefilled cache (a copy for one of them), eager and compiled, alternating which goes
first from run to run. The ``compiled_*`` figures are their medians, MBU held to the same bytes per step. A
compile during the timed runs (which would be timed as decoding) is an error.

The prompt is fixed pseudo-random token ids: the work of a forward does not depend on which tokens.
"""

import contextlib
import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from qinfer.errors import QinferError
from qinfer.evals.costs import decode_bytes, decode_flops, prefill_bytes, prefill_flops, prefill_flops_by_dtype
from qinfer.evals.roofline import DTYPES, Roofline, mbu, mfu
from qinfer.engine.generate import compile_failure_reason, compiled_decode_step, compiled_graphs, decode_step, prefill
from qinfer.engine.sampling import greedy
from qinfer.model.kv_cache import KVCache, make_cache
from qinfer.model.decoder import Transformer

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_WARMUP_PROMPT, _WARMUP_STEPS = 16, 2


@dataclass(frozen=True)
class SpeedResult:
    prompt_tokens: int
    decode_steps: int
    repeats: int
    kv_cache: str
    compute_dtype: str  # "bf16" or "fp32": the dtype most of the prefill's FLOPs multiply in
    ttft_s: float  # median time to first token: prefill + its argmax
    prefill_tok_s: float  # prompt_tokens / median TTFT
    tpot_s: float  # median over runs of the mean seconds per decode step
    decode_tok_s: float  # 1 / tpot_s
    decode_context: float  # mean number of cached positions over the decode steps
    decode_bytes: int  # bytes read per decode step at that context
    decode_flops: int
    prefill_bytes: int
    prefill_flops: int
    mbu: float
    mfu_prefill: float
    threads: int
    prefill_flops_by_dtype: dict[str, int] = field(default_factory=dict)  # what MFU holds to each dtype's peak
    # with compiled (else None): the compiled decode step, timed beside the eager one
    compile_s: float | None = None  # the compiled warm-up run's wall time, nearly all of it compiling
    compiled_tpot_s: float | None = None
    compiled_decode_tok_s: float | None = None
    compiled_mbu: float | None = None


def _run(model: Transformer, prompt: torch.Tensor, steps: int, kv_dtype: str, compiled=None,
         compiled_first: bool = False) -> tuple[float, float, KVCache, float | None]:
    """(seconds to first token, mean seconds per eager decode step, the filled cache, and with a ``compiled``
    step function the mean seconds per compiled step from a copy of the same prefilled cache) of one run."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    # a spare position: a compiled step whose keys fill the whole cache would be another graph
    cache = make_cache(model, 1, prompt.shape[1] + steps + 1, kv_dtype)
    sync()
    t0 = time.perf_counter()
    token = greedy(prefill(model, prompt, cache))
    sync()
    ttft = time.perf_counter() - t0
    if compiled is None:
        return ttft, _decode(model, decode_step, token, prompt.shape[1], cache, steps, sync), cache, None
    spare = copy.deepcopy(cache)
    if compiled_first:
        compiled_tpot = _decode(model, compiled, token, prompt.shape[1], spare, steps, sync)
    tpot = _decode(model, decode_step, token, prompt.shape[1], cache, steps, sync)
    if not compiled_first:
        compiled_tpot = _decode(model, compiled, token, prompt.shape[1], spare, steps, sync)
    return ttft, tpot, cache, compiled_tpot


def _decode(model: Transformer, step, token: torch.Tensor, start: int, cache: KVCache, steps: int, sync) -> float:
    """Mean seconds per ``step`` over ``steps`` greedy decode steps from position ``start``."""
    t0 = time.perf_counter()
    for pos in range(start, start + steps):
        token = greedy(step(model, token, pos, cache))
    sync()
    return (time.perf_counter() - t0) / steps


def checked_prompt(model: Transformer, prompt_tokens: int, decode_steps: int) -> torch.Tensor:
    """The fixed pseudo-random prompt of ``prompt_tokens`` ids, after checking the run fits the model."""
    if prompt_tokens + decode_steps > model.config.max_position_embeddings:
        raise QinferError(
            f"a {prompt_tokens}-token prompt + {decode_steps} decode steps exceed the model's context of "
            f"{model.config.max_position_embeddings} tokens"
        )
    if set(prefill_flops_by_dtype(model, prompt_tokens)) - set(_DTYPE_NAMES):
        raise QinferError(f"no roofline ceiling for compute dtype {model.dtype}; load the model in bf16 or fp32")
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=generator).to(model.device)


def measure_speeds(
    models: Sequence[Transformer],
    roofline: Roofline,
    kv_dtype: str = "bf16",
    prompt_tokens: int = 512,
    decode_steps: int = 16,
    repeats: int = 3,
    desc: str = "speed",
    progress: bool = True,
    compiled: bool = False,
) -> list[SpeedResult]:
    """The speed of each of ``models``, measured in rounds (see the module docstring); with ``compiled``,
    the compiled decode step's too."""
    if prompt_tokens < 1 or decode_steps < 1 or repeats < 1:
        raise QinferError(
            f"speed needs a prompt, decode steps and repeats of at least 1 (got {prompt_tokens}, {decode_steps}, {repeats})"
        )
    prompts = [checked_prompt(model, prompt_tokens, decode_steps) for model in models]
    for model, prompt in zip(models, prompts):
        _run(model, prompt[:, :_WARMUP_PROMPT], _WARMUP_STEPS, kv_dtype)  # eager first: builds weight layouts
    step = compiled_decode_step() if compiled else None
    compile_s: list[float | None] = [None] * len(models)
    # a graph or two per model
    with _recompile_limit(2 * len(models)) if compiled else contextlib.nullcontext():
        if compiled:
            for i, (model, prompt) in enumerate(tqdm(list(zip(models, prompts)), desc="compiling the decode step",
                                                     unit="model", disable=not progress)):
                compile_s[i] = _compile(model, prompt, decode_steps, kv_dtype, step)
        graphs = compiled_graphs() if compiled else 0
        times: list[list[tuple[float, float, float | None]]] = [[] for _ in models]
        caches: list[KVCache | None] = [None] * len(models)
        with tqdm(total=repeats * len(models), desc=desc, unit="run", disable=not progress) as bar:
            for r in range(repeats):
                for i, (model, prompt) in enumerate(zip(models, prompts)):
                    extra = {} if step is None else {"compiled": step, "compiled_first": r % 2 == 1}
                    ttft, tpot, caches[i], compiled_tpot = _run(model, prompt, decode_steps, kv_dtype, **extra)
                    times[i].append((ttft, tpot, compiled_tpot))
                    bar.update()
    if compiled and compiled_graphs() != graphs:
        raise QinferError("the compiled decode step compiled again during the timed runs, so its time would count "
                          "compiling: measure without --compile, and report this as a bug")
    return [
        _result(model, runs, cache, roofline, kv_dtype, prompt_tokens, decode_steps, seconds)
        for model, runs, cache, seconds in zip(models, times, caches, compile_s)
    ]


def _recompile_limit(graphs: int):
    """Dynamo's recompile limit raised to at least ``graphs`` (its default, 8 per function, would leave later models
    eager); imports torch._dynamo, so only where compiling."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, graphs))


def _compile(model: Transformer, prompt: torch.Tensor, steps: int, kv_dtype: str, step) -> float:
    """Seconds of one run through the compiled ``step`` at the timed positions (its first step compiles)."""
    t0 = time.perf_counter()
    try:
        _run(model, prompt, steps, kv_dtype, compiled=step)
    except Exception as e:  # no C++ compiler, an op inductor cannot lower, ...
        raise QinferError(f"--compile: torch.compile failed ({compile_failure_reason(e)}); measure without "
                          "--compile") from None
    return time.perf_counter() - t0


def _result(model: Transformer, runs: list[tuple[float, float, float | None]], cache: KVCache, roofline: Roofline,
            kv_dtype: str, prompt_tokens: int, decode_steps: int, compile_s: float | None = None) -> SpeedResult:
    """One model's figures from its runs' (TTFT, TPOT, compiled TPOT or None); ``cache`` is the one its last run
    filled (its bytes per position and its scales, as the runs used them)."""
    by_dtype = {_DTYPE_NAMES[d]: n for d, n in prefill_flops_by_dtype(model, prompt_tokens).items()}
    ttft = statistics.median(r[0] for r in runs)
    tpot = statistics.median(r[1] for r in runs)
    compiled_tpot = None if compile_s is None else statistics.median(r[2] for r in runs)
    context = prompt_tokens + (decode_steps - 1) / 2  # the steps see prompt_tokens .. prompt_tokens + steps - 1
    step_bytes = decode_bytes(model, cache, round(context))
    step_flops = decode_flops(model, round(context))
    fill_flops = prefill_flops(model, prompt_tokens)
    return SpeedResult(
        prompt_tokens=prompt_tokens,
        decode_steps=decode_steps,
        repeats=len(runs),
        kv_cache=kv_dtype,
        compute_dtype=max(by_dtype, key=by_dtype.get),
        ttft_s=ttft,
        prefill_tok_s=prompt_tokens / ttft,
        tpot_s=tpot,
        decode_tok_s=1.0 / tpot,
        decode_context=context,
        decode_bytes=step_bytes,
        decode_flops=step_flops,
        prefill_bytes=prefill_bytes(model, cache, prompt_tokens),
        prefill_flops=fill_flops,
        mbu=mbu(step_bytes, tpot, roofline),
        mfu_prefill=mfu(by_dtype, ttft, roofline),
        threads=torch.get_num_threads(),
        prefill_flops_by_dtype=by_dtype,
        compile_s=compile_s,
        compiled_tpot_s=compiled_tpot,
        compiled_decode_tok_s=None if compiled_tpot is None else 1.0 / compiled_tpot,
        compiled_mbu=None if compiled_tpot is None else mbu(step_bytes, compiled_tpot, roofline),
    )
