"""The C kernels of a decode step (``qinfer.kernels``' ``gemv_cpu``, ``norm_cpu`` and ``attention_cpu``: GEMVs,
RMSNorm, attention) against PyTorch's, side by side on one model.

    python -m qinfer.evals.diagnostics.gemv_bench MODEL [--prompt-tokens 512] [--steps 8] [--rounds 5] [--calls 50]
    python -m qinfer.evals.diagnostics.gemv_bench MODEL --rows 1,4,16,64 [--rounds 5] [--calls 50]
    python -m qinfer.evals.diagnostics.gemv_bench MODEL --bf16-loops [--rows 1,4,16,64] [--rounds 5] [--calls 50]
    python -m qinfer.evals.diagnostics.gemv_bench MODEL --int8-loops [--rows 1,4,16,64] [--rounds 5] [--calls 50]

Two parts, each alternating the two paths so a machine that slows down for a while slows both:
1. every distinct linear of the model (kind, shape), one bf16 row through ``qinfer.kernels.linear``: the
   median time of ``--calls`` calls of each path per round, over ``--rounds`` rounds, and the bytes of the
   weight (codes, scales, zeros) over that time;
2. whole decode steps (``qinfer eval``'s speed setting: a fixed prompt prefilled into a bf16 KV cache, greedy
   steps at batch 1), ``--steps`` steps of each path per round from copies of one cache state, and whether
   their greedy tokens agree; and, in the same rounds, the C GEMVs' steps on a second copy of the model whose
   weights stay in the checkpoint's file map (4 KiB pages) against the copy in 2 MiB pages that the qinfer
   commands run (``qinfer.model.loader.into_huge_pages``), where the OS has transparent huge pages; the C GEMVs
   with PyTorch's ops for RMSNorm and the attention (``cpu_library.only_gemvs``); the C kernels with q/k/v and
   gate/up multiplied one linear at a time (``qinfer.model.decoder.separate_linears``) instead of fused; and, on a CPU
   with AVX-VNNI or AVX512-VNNI, the C kernels with 4-bit rows through the AVX2 float loop
   (``cpu_library.without_vnni``) instead of the VNNI one; on a CPU with AMX-BF16, the C kernels with bf16 rows
   through the AVX512-BF16 loop (``cpu_library.bf16_without_amx``) instead of the AMX one.

With ``--rows``, instead: every distinct linear against M rows of x for each M given (a batch of decode steps),
three paths side by side in alternating rounds: the path ``qinfer.kernels.linear`` took before the C GEMVs took
several rows (``gemv_cpu.one_row_only``: for M > 1 oneDNN's bf16 matmul, PyTorch's int4 kernel ``int4_cpu``, or a
dense matmul after the C dequantize; named in the table), the C GEMV on the M rows in one call, and M one-row
calls of it. Each path's time is the median of up to ``--calls`` calls per round (fewer where a call is slow: about
a quarter second of them per path and round), then the median over rounds; ``ratio`` is before / C rows.

With ``--bf16-loops``, instead: every distinct bf16 linear's C GEMV on M rows of x (``--rows``, else one) through
each bf16 dot-product loop this CPU has (``cpu_library.bf16_loops``: AMX-BF16, AVX512-BF16) side by side in
alternating rounds, timed as ``--rows`` times them; the time and the weight's bytes over it per loop, and ``ratio``,
the last loop's time over the first's (AVX512-BF16 over AMX-BF16 where the CPU has both). ``--int8-loops`` does the
same for every 8-bit linear (an ``--quantize-lm-head`` lm_head) that takes the loop over tiles, through AMX-INT8
(where ``cpu_library.int8_loops`` has it) and the AVX512-VNNI loop (``cpu_library.int8_without_amx``).

Diagnostic only, CPU only: nothing is written, nothing cached.
"""

import contextlib
import statistics
import time

import click
import torch

from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.evals.diagnostics.decode_profile import alternating_rounds, check_context, warmed_up
from qinfer.evals.roofline import threads_text
from qinfer.format import Fp8Weight, QuantizedWeight
from qinfer.engine.generate import decode_step
from qinfer.kernels import cpu_library, fp8_cpu, gemv_cpu, int4_cpu, int8_cpu
from qinfer.kernels.linear import linear
from qinfer.model.loader import huge_pages_reason, load_model
from qinfer.model.decoder import QLinear, fuse_linears, separate_linears
from qinfer.sources.resolve import resolve_model


@click.command(cls=Command)
@click.argument("model")
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--steps", type=int, default=8, show_default=True, help="Decode steps of each path per round.")
@click.option("--rounds", type=int, default=5, show_default=True)
@click.option("--calls", type=int, default=50, show_default=True, help="Calls of each linear per path and round.")
@click.option("--rows", default=None, help="Row counts M, comma-separated (e.g. 1,4,16,64): time each linear's M-row "
              "C GEMV against the path taken before and M one-row calls, instead of the one-row table and the steps.")
@click.option("--bf16-loops", is_flag=True, help="Time each bf16 linear's C GEMV on M rows (--rows, else 1) through "
              "each bf16 dot-product loop this CPU has (AMX-BF16, AVX512-BF16) side by side, instead.")
@click.option("--int8-loops", is_flag=True, help="Time each 8-bit linear's C GEMV on M rows (--rows, else 1) through "
              "AMX-INT8 (where this CPU has it) and the AVX512-VNNI loop side by side, instead.")
def main(model, prompt_tokens, steps, rounds, calls, rows, bf16_loops, int8_loops):
    if min(prompt_tokens, steps, rounds, calls) < 1:
        raise QinferError("--prompt-tokens, --steps, --rounds and --calls must be at least 1")
    counts = _row_counts(rows) if rows is not None else None
    if not cpu_library.available():
        raise QinferError(f"the C GEMV kernels are not in use here ({cpu_library.unavailable_reason()})")
    if bf16_loops:
        _loops_report(model, counts or [1], rounds, calls, "bf16")
    elif int8_loops:
        _loops_report(model, counts or [1], rounds, calls, "int8")
    elif counts:
        _rows_report(model, counts, rounds, calls)
    else:
        _report(model, prompt_tokens, steps, rounds, calls)


def _row_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise QinferError(f"--rows takes row counts of 1 or more, comma-separated (e.g. 1,4,16,64); got {text!r}")
    return counts


def _weight_bytes(w) -> int:
    if isinstance(w, QuantizedWeight):
        tensors = (w.qweight, w.scale, w.zero)
    else:
        tensors = (w.weight, w.scale) if isinstance(w, Fp8Weight) else (w,)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _kind(w) -> str:
    if isinstance(w, QuantizedWeight):
        return f"int{w.bits} g{w.group_size}"
    return "fp8 e4m3" if isinstance(w, Fp8Weight) else str(w.dtype).replace("torch.", "")


def _timed(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _linears(model) -> dict:
    """(kind, (N, K)) -> [one such weight, how many the model has]"""
    weights = {}
    for module in model.modules():
        if isinstance(module, QLinear):
            weights.setdefault((_kind(module.weight), tuple(module.weight.shape)), [module.weight, 0])[1] += 1
    return weights


def _c_gemv(w):
    """The C GEMV for weight w, called directly (whatever its row limit)"""
    if isinstance(w, QuantizedWeight):
        return lambda x: gemv_cpu.int_gemv(x, w)
    return (lambda x: gemv_cpu.fp8_gemv(x, w)) if isinstance(w, Fp8Weight) else lambda x: gemv_cpu.bf16_gemv(x, w)


def _path_before(w, x: torch.Tensor) -> str:
    """What ``linear(x, w)`` ran before the C GEMVs took several rows, as ``qinfer.kernels.quant_linear`` and
    ``dense`` choose it"""
    with gemv_cpu.one_row_only():
        if isinstance(w, QuantizedWeight):
            if gemv_cpu.int_supported(x, w):
                return "C GEMV"
            if int4_cpu.supported(x, w):
                return "aten int4pack mm"
            return "int8 mm per group" if int8_cpu.supported(x, w) else "C dequant + matmul"
        if isinstance(w, Fp8Weight):
            if gemv_cpu.fp8_supported(x, w):
                return "C GEMV"
            return "fp16 move" if fp8_cpu.supported(x, w) else "C dequant + matmul"
        return "C GEMV" if gemv_cpu.bf16_supported(x, w) else "oneDNN matmul"


def _timed_budget(fn, calls: int, budget: float = 0.25) -> float:
    """The median time of up to ``calls`` calls of fn, fewer (at least 3) where they would take past ``budget`` s"""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    return _timed(fn, max(3, min(calls, int(budget / max(first, 1e-9)))))


@torch.no_grad()
def _rows_report(model_name: str, counts: list[int], rounds: int, calls: int) -> None:
    model = load_model(resolve_model(model_name), run=True)
    print(f"{model_name}: {threads_text(torch.get_num_threads())}; medians over {rounds} alternating rounds; "
          f"C rows: one call of M rows, C 1-row x M: M calls")
    print(f"{'weight':>12} {'N x K':>13} {'M':>3} {'before':>18} {'before us':>10} {'C rows us':>10} "
          f"{'C 1-row x M us':>14} {'ratio':>6}")
    for (kind, (N, K)), (w, _) in _linears(model).items():
        gemv = _c_gemv(w)
        for M in counts:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(model.dtype)
            paths = {"before": lambda: linear(x, w), "rows": lambda: gemv(x),
                     "ones": lambda: [gemv(x[m : m + 1]) for m in range(M)]}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for r in range(rounds):
                for name in list(paths) if r % 2 == 0 else list(paths)[::-1]:
                    with gemv_cpu.one_row_only() if name == "before" else contextlib.nullcontext():
                        times[name].append(_timed_budget(paths[name], calls))
            b, c, o = (statistics.median(times[name]) * 1e6 for name in paths)
            print(f"{kind:>12} {f'{N} x {K}':>13} {M:3d} {_path_before(w, x):>18} {b:10.1f} {c:10.1f} {o:14.1f} "
                  f"{b / c:6.2f}")


def _loop_choices(which: str) -> dict:
    """The loops ``--bf16-loops`` or ``--int8-loops`` compares on this CPU: name -> the context that selects it"""
    if which == "bf16":
        return {name: lambda name=name: cpu_library.with_bf16_loop(name) for name in cpu_library.bf16_loops()}
    if "AMX-INT8" not in cpu_library.int8_loops() or cpu_library.int4_vnni() != "AVX512-VNNI":
        return {}
    return {"AMX-INT8": lambda: cpu_library.with_int8_loop("AMX-INT8 at every M"),
            "AVX512-VNNI": cpu_library.int8_without_amx}


@torch.no_grad()
def _loops_report(model_name: str, counts: list[int], rounds: int, calls: int, which: str) -> None:
    choices = _loop_choices(which)
    if not choices:
        raise QinferError("no bf16 dot-product loop here (the CPU, compiler or OS allow neither AMX-BF16 nor "
                          "AVX512-BF16)" if which == "bf16" else "no AMX-INT8 loop beside AVX512-VNNI here (the "
                          "CPU, compiler or OS do not allow it)")
    loops = list(choices)
    model = load_model(resolve_model(model_name), run=True)
    print(f"{model_name}: {threads_text(torch.get_num_threads())}; medians over {rounds} alternating rounds; "
          f"one C GEMV call of M {'bf16' if which == 'bf16' else str(model.dtype).replace('torch.', '')} rows "
          "through each loop")
    print(f"{'N x K':>13} {'M':>3} " + " ".join(f"{name + ' us':>14} {'GB/s':>6}" for name in loops) + f" {'ratio':>6}")
    if which == "bf16":
        weights = [(shape, w) for (kind, shape), (w, _) in _linears(model).items() if kind == "bfloat16"]
    else:  # the 8-bit linears the loop over tiles takes
        weights = [(shape, w) for (kind, shape), (w, _) in _linears(model).items() if kind.startswith("int8")
                   and gemv_cpu._tiled(model.dtype, shape[1] if w.group_size == -1 else w.group_size, 8)]
    if not weights:
        print(f"no {'bf16' if which == 'bf16' else '8-bit tiled'} linears in {model_name}")
    for (N, K), w in weights:
        gemv = _c_gemv(w)
        for M in counts:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(
                torch.bfloat16 if which == "bf16" else model.dtype)
            times: dict[str, list[float]] = {name: [] for name in loops}
            for r in range(rounds):
                for name in loops if r % 2 == 0 else loops[::-1]:
                    with choices[name]():
                        times[name].append(_timed_budget(lambda: gemv(x), calls))
            t = [statistics.median(times[name]) for name in loops]
            gb = _weight_bytes(w) / 1e9
            print(f"{f'{N} x {K}':>13} {M:3d} " + " ".join(f"{s * 1e6:14.1f} {gb / s:6.1f}" for s in t)
                  + f" {t[-1] / t[0]:6.2f}")


@torch.no_grad()
def _report(model_name: str, prompt_tokens: int, steps: int, rounds: int, calls: int) -> None:
    model = load_model(resolve_model(model_name), run=True)
    check_context(model, prompt_tokens, rounds * steps, {"--steps": steps, "--rounds": rounds})  # before part 1
    print(f"{model_name}: {threads_text(torch.get_num_threads())}; medians over {rounds} alternating rounds")
    weights = _linears(model)
    print(f"{'weight':>12} {'N x K':>13} {'count':>5} {'torch us':>9} {'C us':>8} {'torch GB/s':>10} {'C GB/s':>7} "
          f"{'ratio':>6}")
    for (kind, (N, K)), (w, count) in weights.items():
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(0)).to(model.dtype)
        times: dict[str, list[float]] = {"torch": [], "C": []}
        for r in range(rounds):
            for name in (("torch", "C") if r % 2 == 0 else ("C", "torch")):
                with cpu_library.disabled() if name == "torch" else contextlib.nullcontext():
                    linear(x, w)  # warm
                    times[name].append(_timed(lambda: linear(x, w), calls))
        t, c = statistics.median(times["torch"]), statistics.median(times["C"])
        gb = _weight_bytes(w) / 1e9
        print(f"{kind:>12} {f'{N} x {K}':>13} {count:5d} {t * 1e6:9.1f} {c * 1e6:8.1f} {gb / t:10.1f} {gb / c:7.1f} "
              f"{t / c:6.2f}")
    small_pages = None if huge_pages_reason() else load_model(resolve_model(model_name))
    if small_pages is not None:
        fuse_linears(small_pages)  # as the model in 2 MiB pages: only the pages differ
    _decode_steps(model, small_pages, prompt_tokens, steps, rounds)


def _decode_steps(model, small_pages, prompt_tokens: int, steps: int, rounds: int) -> None:
    token, pos, cache = warmed_up(model, prompt_tokens, rounds * steps)
    paths = {"torch": (decode_step, cpu_library.disabled), "C": (decode_step, contextlib.nullcontext)}
    paths["C GEMVs only"] = (decode_step, cpu_library.only_gemvs)
    paths["C, linears apart"] = (decode_step, separate_linears)
    if cpu_library.int4_vnni():
        paths["C, int4 without VNNI"] = (decode_step, cpu_library.without_vnni)
    amx = cpu_library.bf16_loop() == "AMX-BF16" and "AVX512-BF16" in cpu_library.bf16_loops()
    if amx:
        paths["C, bf16 without AMX"] = (decode_step, cpu_library.bf16_without_amx)
    if small_pages is not None:  # the same steps through the other copy of the weights
        paths["C, 4 KiB pages"] = (lambda _, *args: decode_step(small_pages, *args), contextlib.nullcontext)
    times, agree = alternating_rounds(model, token, pos, cache, steps, rounds, paths)
    t, c = (statistics.median(times[k]) * 1000 for k in ("torch", "C"))
    n = statistics.median(times["C GEMVs only"]) * 1000
    print(f"decode step ({prompt_tokens}-token prompt): {t:.1f} ms with PyTorch's kernels, {c:.1f} ms with the C "
          f"kernels ({t / c:.2f}x; medians of {rounds * steps} steps each); greedy tokens "
          f"{'the same' if agree else 'differ'}")
    print(f"decode step with the C GEMVs: {n:.1f} ms with PyTorch's norm and attention ops, {c:.1f} ms with the "
          f"C ones ({n / c:.2f}x)")
    a = statistics.median(times["C, linears apart"]) * 1000
    print(f"decode step with the C kernels: {a:.1f} ms with q/k/v and gate/up one linear at a time, {c:.1f} ms "
          f"fused ({a / c:.2f}x)")
    if "C, int4 without VNNI" in times:
        v = statistics.median(times["C, int4 without VNNI"]) * 1000
        print(f"decode step with the C kernels: {v:.1f} ms with 4-bit rows through the AVX2 float loop, {c:.1f} ms "
              f"through {cpu_library.int4_vnni()} ({v / c:.2f}x)")
    else:
        print("4-bit rows through VNNI: not measured (no AVX-VNNI or AVX512-VNNI here)")
    if amx:
        v = statistics.median(times["C, bf16 without AMX"]) * 1000
        print(f"decode step with the C kernels: {v:.1f} ms with bf16 rows through AVX512-BF16, {c:.1f} ms through "
              f"AMX-BF16 ({v / c:.2f}x)")
    else:
        print(f"bf16 rows through AMX-BF16: not measured (bf16 rows take {cpu_library.bf16_loop() or 'the fp32 loop'})")
    if small_pages is None:
        print(f"weights in 2 MiB pages: not measured ({huge_pages_reason()})")
    else:
        s = statistics.median(times["C, 4 KiB pages"]) * 1000
        print(f"decode step with the C kernels: {s:.1f} ms with the weights in 4 KiB pages (the file map), {c:.1f} "
              f"ms in 2 MiB pages ({s / c:.2f}x)")


if __name__ == "__main__":
    main()
