"""A prefill of a packed model: its weights dequantized in C (``qinfer.kernels.gemv_cpu``) against the format's
PyTorch ops, and where a prompt leaves the CPU int4 kernel (``qinfer.kernels.int4_cpu.max_rows``), side by side.

    python -m qinfer.evals.diagnostics.prefill_bench MODEL [--prompt-tokens 512] [--rows 16,32,64,128,255] [--rounds 5]

Three parts, each alternating its paths round by round so a machine that slows down for a while slows all:
1. every distinct packed weight (kind, shape): one dequantize to the model's dtype through each path, the
   median of ``--calls`` calls per round over ``--rounds`` rounds, and whether the two agree bit for bit;
2. a prefill of ``--prompt-tokens`` (``qinfer eval``'s fixed prompt, into a fresh bf16 KV cache) with each
   dequantize, and whether the last position's logits agree bit for bit;
3. for 4-bit weights, a prefill of each of ``--rows`` tokens through PyTorch's int4 kernel and through the
   C dequantize and the GEMM, beside the limit ``int4_cpu.max_rows`` sets on this CPU.

Diagnostic only, CPU only: nothing is written, nothing cached.
"""

import contextlib
import statistics
import time

import click
import torch

from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.evals.diagnostics.gemv_bench import _kind, _timed
from qinfer.evals.roofline import threads_text
from qinfer.evals.speed import checked_prompt
from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.engine.generate import prefill
from qinfer.kernels import cpu_library, gemv_cpu, int4_cpu
from qinfer.model.kv_cache import make_cache
from qinfer.model.loader import load_model
from qinfer.model.decoder import QLinear
from qinfer.sources.resolve import resolve_model

PATHS = ("torch", "C")


@click.command(cls=Command)
@click.argument("model")
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--rows", default="16,32,64,128,255", show_default=True,
              help="Prompt lengths that part 3 prefills through the int4 kernel and through the dequantize.")
@click.option("--rounds", type=int, default=5, show_default=True)
@click.option("--calls", type=int, default=20, show_default=True, help="Dequantize calls of each weight per path and round.")
def main(model, prompt_tokens, rows, rounds, calls):
    try:
        lengths = [int(r) for r in rows.split(",") if r.strip()]
    except ValueError:
        raise QinferError(f"--rows takes prompt lengths separated by commas, got {rows!r}") from None
    if min(prompt_tokens, rounds, calls, *lengths) < 1:
        raise QinferError("--prompt-tokens, --rows, --rounds and --calls must be at least 1")
    if not cpu_library.available():
        raise QinferError(f"the C kernels are not in use here ({cpu_library.unavailable_reason()})")
    _report(model, prompt_tokens, lengths, rounds, calls)


def _c_dequantize(w, dtype: torch.dtype) -> torch.Tensor | None:
    """``w.dequantize(dtype)`` through the C loop, or None where it does not take ``w``."""
    if isinstance(w, QuantizedWeight) and gemv_cpu.dequantize_supported(w, dtype):
        return w.unpermute(gemv_cpu.dequantize(w, dtype))
    if isinstance(w, Fp8Weight) and gemv_cpu.fp8_dequantize_supported(w, dtype):
        return gemv_cpu.fp8_dequantize(w, dtype)
    return None


def _alternating(paths: dict, rounds: int) -> dict[str, list[float]]:
    """Each path's times over ``rounds`` rounds, alternating which goes first; a path is a () -> seconds."""
    names = list(paths)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(paths[name]())
    return times


def _prefill_seconds(model, prompt: torch.Tensor, context) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of ``prompt`` into a fresh cache inside ``context()``, and its last logits."""
    cache = make_cache(model, 1, prompt.shape[1], "bf16")
    with context():
        t0 = time.perf_counter()
        logits = prefill(model, prompt, cache)
        return time.perf_counter() - t0, logits


@torch.no_grad()
def _report(model_name: str, prompt_tokens: int, lengths: list[int], rounds: int, calls: int) -> None:
    model = load_model(resolve_model(model_name), run=True)
    weights = {}
    for module in model.modules():
        if isinstance(module, QLinear) and isinstance(module.weight, (QuantizedWeight, Fp8Weight)):
            weights.setdefault((_kind(module.weight), tuple(module.weight.shape)), [module.weight, 0])[1] += 1
    if not weights:
        raise QinferError(f"{model_name} has no packed weights: nothing is dequantized in its prefill")
    four_bit = any(isinstance(w, QuantizedWeight) and w.bits == 4 for w, _ in weights.values())
    limit = model.config.max_position_embeddings
    for option, tokens in (("--prompt-tokens", prompt_tokens), ("--rows", max(lengths) if four_bit else 0)):
        if tokens > limit:  # before part 1, not after it
            raise QinferError(f"{option} asks for a {tokens}-token prompt, longer than the model's context of "
                              f"{limit} tokens: lower {option}")
    print(f"{model_name}: {threads_text(torch.get_num_threads())}; medians over {rounds} alternating rounds")
    print(f"{'weight':>12} {'N x K':>13} {'count':>5} {'torch ms':>9} {'C ms':>8} {'ratio':>6}  same bits")
    for (kind, (N, K)), (w, count) in weights.items():
        if _c_dequantize(w, model.dtype) is None:
            print(f"{kind:>12} {f'{N} x {K}':>13} {count:5d}  (no C dequantize for it: PyTorch's ops on both paths)")
            continue
        same = torch.equal(_c_dequantize(w, model.dtype), w.dequantize(model.dtype))
        times = _alternating({"torch": lambda: _timed(lambda: w.dequantize(model.dtype), calls),
                              "C": lambda: _timed(lambda: _c_dequantize(w, model.dtype), calls)}, rounds)
        t, c = statistics.median(times["torch"]), statistics.median(times["C"])
        print(f"{kind:>12} {f'{N} x {K}':>13} {count:5d} {t * 1e3:9.3f} {c * 1e3:8.3f} {t / c:6.2f}  "
              f"{'yes' if same else 'NO'}")

    prompt = checked_prompt(model, prompt_tokens, 0)
    logits = {}

    def run(name):
        context = cpu_library.pytorch_dequantize if name == "torch" else contextlib.nullcontext
        seconds, logits[name] = _prefill_seconds(model, prompt, context)
        return seconds

    run("C")  # warm: pages, threads, oneDNN's kernels
    times = _alternating({name: (lambda name=name: run(name)) for name in PATHS}, rounds)
    t, c = (statistics.median(times[name]) * 1000 for name in PATHS)
    print(f"prefill ({prompt.shape[1]} tokens): {t:.1f} ms dequantizing with PyTorch's ops, {c:.1f} ms in C "
          f"({t / c:.2f}x); last logits {'the same' if torch.equal(logits['torch'], logits['C']) else 'differ'}")

    if not four_bit:
        return
    limit = int4_cpu.max_rows(model.dtype)
    print(f"4-bit prompts: the int4 kernel below {limit} rows here, the C dequantize and a GEMM from there on")
    for T in lengths:
        prompt = checked_prompt(model, T, 0)
        paths = {"kernel": lambda: int4_cpu.rows_limit(1 << 30), "dequantize": lambda: int4_cpu.rows_limit(0)}
        times = _alternating({name: (lambda ctx=ctx: _prefill_seconds(model, prompt, ctx)[0])
                              for name, ctx in paths.items()}, rounds)
        k, d = (statistics.median(times[name]) * 1000 for name in paths)
        print(f"  {T:5d} tokens: {k:8.1f} ms through the int4 kernel, {d:8.1f} ms dequantized ({k / d:.2f}x)")


if __name__ == "__main__":
    main()
