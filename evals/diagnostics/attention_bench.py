"""Decode attention over the paged KV cache on this CPU, against the read bandwidth ``qinfer roofline`` measured.

    python -m qinfer.evals.diagnostics.attention_bench [--contexts 512,4096,32768] [--batches 1,16]
        [--dtypes bf16,int8,fp8] [--heads 4 --kv-heads 1 --head-dim 256] [--repeats 7]

One layer's decode step, as the model runs it (``qinfer.kernels.attention.paged_decode``: the C loop reading the
pages through the block tables), for every context length, batch and page dtype: sequences of that many
positions in shuffled blocks of 16, one query row each. The time is the median of ``--repeats`` timed calls
(after one warm-up); the bytes are what the step must read (``triton_attention.decode_cost``: every key and value
once, as stored, with its position scale for codes, plus the queries and outputs), so GB/s over the measured
bandwidth says how close the loop comes to the memory limit; the FLOPs (4 per query head, position and channel)
over the fp32 matmul peak say how close it comes to the arithmetic one, which binds first where many query heads
share a KV head of one-byte codes. One line per case:

    int8 4k batch 1: 12.3 GB/s = 71% of 17.2 GB/s (0.18 ms, 2.2 MB; fp32 FLOPs at 40% of the peak)

(int8 codes on a CPU with AVX512-VNNI: the line goes on with the default integer loop's gap from the fp32 loop's
output, then the other loops' times, ``cpu_library.attention_loops`` and the fp32 one, timed alternating with the
default call by call, since sub-millisecond timings move between runs), then how many positions one GiB of KV memory
holds per dtype for a whole model of this shape (``--layers``), and, labelled as a projection, the time the Triton
kernel would take on an H100 at its datasheet bandwidth and bf16 peak (3.35 TB/s, 989 TFLOP/s): the larger of bytes
/ bandwidth and FLOPs / peak, i.e. what a kernel streaming at the limit would take; nothing here ran on a GPU.
Defaults: gemma3-270m's attention (4 query heads, 1 KV head, head_dim 256, 18 layers). Diagnostic only: nothing is
written, nothing cached.
"""

import contextlib
import statistics
import time

import click
import torch

from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.evals.roofline import measure_roofline, threads_text
from qinfer.kernels import cpu_library
from qinfer.kernels.attention import paged_decode
from qinfer.kernels.paged_attention import quantize_rows
from qinfer.kernels.triton_attention import decode_cost

PAGE_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
BLOCK = 16
H100_BANDWIDTH, H100_BF16_FLOPS = 3.35e12, 989e12  # bytes/s and FLOP/s, NVIDIA's H100 SXM datasheet


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise QinferError(f"--{name} takes a comma-separated list of positive integers (got {text!r})")
    return values


@click.command(cls=Command)
@click.option("--contexts", default="512,4096,32768", show_default=True, help="Positions per sequence.")
@click.option("--batches", default="1,16", show_default=True, help="Sequences per decode step.")
@click.option("--dtypes", default="bf16,int8,fp8", show_default=True, help="Page dtypes.")
@click.option("--heads", type=int, default=4, show_default=True)
@click.option("--kv-heads", type=int, default=1, show_default=True)
@click.option("--head-dim", type=int, default=256, show_default=True)
@click.option("--layers", type=int, default=18, show_default=True, help="For the positions per GiB of a whole model.")
@click.option("--repeats", type=int, default=7, show_default=True)
def main(contexts, batches, dtypes, heads, kv_heads, head_dim, layers, repeats):
    contexts, batches = _ints(contexts, "contexts"), _ints(batches, "batches")
    kinds = [d.strip() for d in dtypes.split(",") if d.strip()]
    if not kinds or any(d not in PAGE_DTYPES for d in kinds):
        raise QinferError(f"--dtypes takes a comma-separated list of {', '.join(PAGE_DTYPES)} (got {dtypes!r})")
    if min(heads, kv_heads, head_dim, layers, repeats) < 1 or heads % kv_heads or head_dim % 8:
        raise QinferError("--heads must be a multiple of --kv-heads, --head-dim a multiple of 8, all positive")
    if not cpu_library.available():
        raise QinferError(f"the C kernels are not in use here ({cpu_library.unavailable_reason()})")
    roofline = measure_roofline("cpu")
    bandwidth, peak = roofline.bandwidth_gbs, roofline.peak_tflops.get("fp32")
    click.echo(f"paged decode attention, {heads} query heads / {kv_heads} KV heads of {head_dim}, blocks of {BLOCK}, "
               f"{threads_text(torch.get_num_threads())}; read bandwidth {bandwidth:.1f} GB/s, fp32 matmul peak "
               f"{peak or float('nan'):.3f} TFLOP/s (qinfer roofline)")
    projected = []
    for kind in kinds:
        for context in contexts:
            for batch in batches:
                seconds, (moved, flops), note = _time_case(kind, context, batch, heads, kv_heads, head_dim, repeats)
                gbs = moved / seconds / 1e9
                compute = f"; fp32 FLOPs at {flops / seconds / 1e12 / peak:.0%} of the peak" if peak else ""
                click.echo(f"{kind} {_short(context)} batch {batch}: {gbs:.1f} GB/s = {gbs / bandwidth:.0%} of "
                           f"{bandwidth:.1f} GB/s ({seconds * 1e3:.3f} ms, {moved / 1e6:.1f} MB{compute}{note})")
                projected.append((kind, context, batch, max(moved / H100_BANDWIDTH, flops / H100_BF16_FLOPS)))
    click.echo("positions per GiB of KV memory, whole model "
               f"({layers} layers): " + ", ".join(
                   f"{kind} {_per_gib(kind, kv_heads, head_dim, layers):,}" for kind in kinds))
    click.echo("projection, not a measurement: the Triton paged decode kernel at an H100's 3.35 TB/s and "
               "989 TFLOP/s bf16, if it streams at the limit:")
    for kind, context, batch, seconds in projected:
        click.echo(f"  {kind} {_short(context)} batch {batch}: {seconds * 1e6:.1f} us")


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _per_gib(kind: str, kv_heads: int, head_dim: int, layers: int) -> int:
    row = head_dim * PAGE_DTYPES[kind].itemsize + (4 if kind != "bf16" else 0)  # codes and a position scale
    return (1 << 30) // (2 * kv_heads * row * layers)


def _time_case(kind, context, batch, heads, kv_heads, head_dim, repeats) -> tuple[float, tuple[int, int], str]:
    """The median seconds of one decode step's attention over ``batch`` sequences of ``context`` positions, the
    (bytes, FLOPs) it must move and do, and for int8 codes through the integer loops, the other loops' times (timed
    alternating with the default, call by call: this one's timings move between runs) and how far each loop's
    output lands from the fp32 loop's (the largest difference over the largest output)."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq
    shape = (blocks, kv_heads, BLOCK, head_dim)
    tables = torch.randperm(blocks, generator=g).view(batch, per_seq)  # each sequence's blocks, scattered
    scales = None
    if kind == "bf16":
        k_pages, v_pages = (torch.randn(shape, generator=g).bfloat16() for _ in range(2))
    else:
        ones = torch.ones(kv_heads, head_dim)
        (k_pages, k_pos), (v_pages, v_pos) = (quantize_rows(torch.randn(shape, generator=g).transpose(1, 2), ones,
                                                            PAGE_DTYPES[kind]) for _ in range(2))
        k_pages, v_pages = k_pages.transpose(1, 2).contiguous(), v_pages.transpose(1, 2).contiguous()
        k_pos, v_pos = k_pos.transpose(1, 2).contiguous(), v_pos.transpose(1, 2).contiguous()
        scales = (ones, ones, k_pos, v_pos)
    q = torch.randn(batch, heads, 1, head_dim, generator=g).bfloat16()
    call = lambda: paged_decode(q, k_pages, v_pages, tables, 0, context, head_dim ** -0.5, scales)  # noqa: E731
    # int8 codes through an integer loop: also the other integer loops and the fp32 one, alternating call by call
    loops = cpu_library.attention_loops() if kind == "int8" and cpu_library.attention_vnni() else []
    times = {name: [] for name in [None, *loops[1:], ""]} if loops else {None: []}  # None: the default
    outs = {}
    for i in range(repeats + 1):
        for name, spent in times.items():
            with contextlib.nullcontext() if name is None else cpu_library.with_attention_loop(name):
                t0 = time.perf_counter()
                outs[name] = call()
                if i:  # the first calls warm up
                    spent.append(time.perf_counter() - t0)
    note = ""
    if loops:  # how far the integer loops land from the fp32 one, and their times in the same run
        exact = outs[""].float()
        gaps = {name: float((out.float() - exact).abs().max() / exact.abs().max()) for name, out in outs.items()}
        note = f"; {loops[0]}, within {gaps[None]:.1e} of the fp32 loop" + "".join(
            f"; {name or 'fp32 loop'} {statistics.median(times[name]) * 1e3:.3f} ms"
            + (f" (within {gaps[name]:.1e})" if name else "") for name in times if name is not None)
    kv_bytes = PAGE_DTYPES[kind].itemsize
    return statistics.median(times[None]), decode_cost([context] * batch, heads, kv_heads, head_dim, kv_bytes), note


if __name__ == "__main__":
    main()
