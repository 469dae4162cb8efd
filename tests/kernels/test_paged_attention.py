"""The paged references against the plain attention over the same keys and values held contiguously: a page
layout, a block table or a window that read the wrong position shows up as a different output."""

import pytest
import torch

from qinfer.kernels.attention import attention_ref
from qinfer.kernels.paged_attention import (
    QMAX,
    gather_ref,
    paged_decode_ref,
    paged_prefill_ref,
    quantize_rows,
    write_pages,
)

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _pages(num_blocks, Hkv, P, D, kv_dtype, g):
    store = CODES.get(kv_dtype, torch.float32)
    pages = [torch.zeros(num_blocks, Hkv, P, D, dtype=store) for _ in "kv"]
    if kv_dtype not in CODES:
        return pages, {}
    scales = {"k_scale": torch.rand(Hkv, D, generator=g) + 0.5, "v_scale": torch.rand(Hkv, D, generator=g) + 0.5,
              "k_pos": torch.ones(num_blocks, Hkv, P), "v_pos": torch.ones(num_blocks, Hkv, P)}
    return pages, scales


def _fill(lengths, Hkv, D, P, kv_dtype, seed=0):
    """Sequences of ``lengths`` written into shuffled blocks: (pages, scales, block tables [B, M], the keys and
    values as stored, dequantized [B][Hkv, S, D])."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // P) for n in lengths]
    num_blocks = sum(need) + 3  # spare blocks that nobody reads
    (k_pages, v_pages), scales = _pages(num_blocks, Hkv, P, D, kv_dtype, g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    stored = []
    for b, n in enumerate(lengths):
        blocks = [order.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(blocks)
        k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
        slots = torch.tensor(blocks)[torch.arange(n) // P] * P + torch.arange(n) % P
        write_pages(k_pages, v_pages, slots, k, v, **scales)
        stored.append(tuple(gather_ref(p, tables[b], 0, n, scales.get(f"{x}_scale"), scales.get(f"{x}_pos"))
                            for p, x in ((k_pages, "k"), (v_pages, "v"))))
        if kv_dtype not in CODES:
            assert torch.equal(stored[-1][0], k.transpose(0, 1)) and torch.equal(stored[-1][1], v.transpose(0, 1))
    return k_pages, v_pages, scales, tables, stored


def _mask(q_pos, k_pos, window):
    mask = k_pos[None, :] <= q_pos[:, None]
    return mask if window is None else mask & (k_pos[None, :] > q_pos[:, None] - window)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("D, group", [(64, 1), (128, 4), (256, 8)])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_decode_matches_attention_over_the_same_keys(kv_dtype, D, group, window):
    Hkv, P, lengths = 2, 16, [1, 5, 123, 33]
    k_pages, v_pages, scales, tables, stored = _fill(lengths, Hkv, D, P, kv_dtype)
    q = torch.randn(len(lengths), Hkv * group, D)
    out = paged_decode_ref(q, k_pages, v_pages, tables, torch.tensor(lengths), D ** -0.5, window, **scales)
    for b, n in enumerate(lengths):
        k, v = stored[b]
        mask = _mask(torch.tensor([n - 1]), torch.arange(n), window)
        expected = attention_ref(q[b][None, :, None], k[None], v[None], mask, D ** -0.5)[0, :, 0]
        torch.testing.assert_close(out[b], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("start, T, window", [(0, 5, None), (13, 20, None), (100, 23, 16), (0, 1000, 256)])
def test_paged_prefill_matches_causal_attention_over_the_same_keys(kv_dtype, start, T, window):
    Hkv, D, P, group = 2, 64, 16, 4
    k_pages, v_pages, scales, tables, stored = _fill([start + T], Hkv, D, P, kv_dtype)
    q = torch.randn(T, Hkv * group, D)
    new_k, new_v = (x[:, start:].transpose(0, 1).contiguous() for x in stored[0])  # the chunk, written again
    out = paged_prefill_ref(q, new_k, new_v, k_pages, v_pages, tables[0], start, D ** -0.5, window, **scales)
    k, v = (gather_ref(p, tables[0], 0, start + T, scales.get(f"{x}_scale"), scales.get(f"{x}_pos"))
            for p, x in ((k_pages, "k"), (v_pages, "v")))
    mask = _mask(torch.arange(start, start + T), torch.arange(start + T), window)
    expected = attention_ref(q.transpose(0, 1)[None], k[None], v[None], mask, D ** -0.5)[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_rows_keep_each_position_within_half_a_step(kv_dtype):
    x = torch.randn(50, 4, 32) * torch.logspace(-3, 3, 50)[:, None, None]  # positions of very different magnitude
    c = torch.rand(4, 32) + 0.5
    codes, pos = quantize_rows(x, c, CODES[kv_dtype])
    assert codes.dtype == CODES[kv_dtype] and pos.shape == (50, 4)
    back = codes.float() * c * pos[..., None]
    top = (x / c).abs().amax(-1, keepdim=True)  # each position's own range: nothing clips
    assert codes.float().abs().amax() <= QMAX[CODES[kv_dtype]]
    rel = 0.5 / 127 if kv_dtype == "int8" else 2.0 ** -4  # half an int8 step; E4M3 keeps 3 mantissa bits
    assert bool(((back - x).abs() / c <= rel * top + 1e-30 * top.max()).all())


def test_an_all_zero_position_stores_zero_codes():
    codes, pos = quantize_rows(torch.zeros(3, 2, 8), torch.ones(2, 8), torch.int8)
    assert not codes.any() and bool((pos > 0).all())


def _c_loop():
    from qinfer.kernels import cpu_library

    if not cpu_library.available():
        pytest.skip(f"the C kernels are not built here: {cpu_library.unavailable_reason()}")


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("D, group", [(64, 1), (128, 4), (256, 8)])
@pytest.mark.parametrize("window", [None, 7])
def test_c_paged_decode_matches_the_reference(kv_dtype, D, group, window):
    from qinfer.kernels.attention_cpu import paged_decode_attention

    _c_loop()
    Hkv, P, lengths = 2, 16, [1, 5, 123, 1000]
    k_pages, v_pages, scales, tables, _ = _fill(lengths, Hkv, D, P, kv_dtype)
    if kv_dtype == "bf16":
        k_pages, v_pages = k_pages.bfloat16(), v_pages.bfloat16()
    q = torch.randn(len(lengths), Hkv * group, D, dtype=torch.bfloat16)
    ends = torch.tensor(lengths)
    starts = ends.sub(window).clamp_min(0) if window else torch.zeros_like(ends)
    out = paged_decode_attention(q[:, :, None], k_pages, v_pages, tables, starts, ends, D ** -0.5, **scales)
    expected = paged_decode_ref(q.float(), k_pages, v_pages, tables, ends, D ** -0.5, window, **scales)
    torch.testing.assert_close(out[:, :, 0].float(), expected, rtol=2e-2, atol=2e-2)  # (one bf16 rounding)


def test_c_paged_decode_sums_as_the_slice_loop_over_the_same_keys():
    # one sequence, its positions gathered into a slice: the same chunks of keys, the same sums, bit for bit
    from qinfer.kernels.attention_cpu import decode_attention, paged_decode_attention

    _c_loop()
    Hkv, D, P, n = 2, 64, 16, 300
    k_pages, v_pages, scales, tables, _ = _fill([n], Hkv, D, P, "int8")
    q = torch.randn(1, 8, 1, D, dtype=torch.bfloat16)
    ends, starts = torch.tensor([n]), torch.tensor([10])
    paged = paged_decode_attention(q, k_pages, v_pages, tables, starts, ends, 0.125, **scales)
    at = torch.arange(10, n)
    block, row = tables[0, at // P].long(), at % P
    k, v = (x[block, :, row].transpose(0, 1)[None] for x in (k_pages, v_pages))
    k_pos, v_pos = (x[block, :, row].transpose(0, 1)[None] for x in (scales["k_pos"], scales["v_pos"]))
    sliced = decode_attention(q, k, v, 0.125, scales["k_scale"], scales["v_scale"], k_pos, v_pos)
    assert torch.equal(paged, sliced)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
def test_c_paged_decode_gives_each_sequence_what_it_gets_alone(kv_dtype):
    # a sequence's chunks of keys follow its own range, so its sums do not depend on the others in the call
    from qinfer.kernels.attention_cpu import paged_decode_attention

    _c_loop()
    Hkv, D, P, lengths = 1, 256, 16, [1, 7, 300, 2500, 40, 1025]
    k_pages, v_pages, scales, tables, _ = _fill(lengths, Hkv, D, P, kv_dtype)
    if kv_dtype == "bf16":
        k_pages, v_pages = k_pages.bfloat16(), v_pages.bfloat16()
    q = torch.randn(len(lengths), 4, 1, D, dtype=torch.bfloat16)
    ends = torch.tensor(lengths)
    starts = (ends - 512).clamp_min(0) * (ends > 1000)  # a window for the long ones
    together = paged_decode_attention(q, k_pages, v_pages, tables, starts, ends, 0.0625, **scales)
    for b in range(len(lengths)):
        alone = paged_decode_attention(q[b:b + 1], k_pages, v_pages, tables[b:b + 1], starts[b:b + 1],
                                       ends[b:b + 1], 0.0625, **scales)
        assert torch.equal(together[b:b + 1], alone), b


def _integer_loop(loop):
    from qinfer.kernels import cpu_library

    _c_loop()
    if loop not in cpu_library.attention_loops():
        pytest.skip(f"this CPU has no {loop} loop (no AVX512-VNNI)")


@pytest.mark.parametrize("loop", ["integer scores and values", "integer scores"])
@pytest.mark.parametrize("D, group", [(64, 1), (128, 4), (256, 8), (256, 3), (96, 2)])
def test_int8_codes_through_integer_dot_products_stay_close_to_the_fp32_loop(loop, D, group):
    # the queries (and the softmax weights) quantized to 15 bits per head (per block of 16 positions): scores
    # within a few thousandths of their range, the output within a bf16 rounding or two of the fp32 loop's
    from qinfer.kernels import cpu_library
    from qinfer.kernels.attention_cpu import paged_decode_attention

    _integer_loop(loop)
    Hkv, P, lengths = 2, 16, [1, 5, 123, 1000, 32, 17]
    k_pages, v_pages, scales, tables, _ = _fill(lengths, Hkv, D, P, "int8")
    q = torch.randn(len(lengths), Hkv * group, 1, D, dtype=torch.bfloat16)
    ends = torch.tensor(lengths)
    args = (q, k_pages, v_pages, tables, torch.zeros_like(ends), ends, D ** -0.5)
    with cpu_library.with_attention_loop(loop):
        assert cpu_library.attention_loop() == loop
        fast = paged_decode_attention(*args, **scales)
    with cpu_library.attention_without_vnni():
        assert not cpu_library.attention_vnni()
        exact = paged_decode_attention(*args, **scales)
    assert cpu_library.attention_loop() == cpu_library.attention_loops()[0]  # the default, back
    torch.testing.assert_close(fast.float(), exact.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(fast, exact)  # (the integer loop did run)


def test_int8_value_sums_keep_small_weights_beside_a_large_one():
    # one position takes nearly all the weight (1 against e^-11.2 each for the other 2999, 4% in all), and its
    # value is 0, the others' 1: the output is the small weights' share. Each block of 16 positions has its own
    # fixed-point step, so the small weights keep 15 bits (one step for the whole chunk would round them all to 0)
    from qinfer.kernels.attention_cpu import decode_attention

    _integer_loop("integer scores and values")
    S, D = 3000, 64
    q = torch.zeros(1, 1, 1, D, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    k, v = torch.zeros(1, 1, S, D, dtype=torch.int8), torch.zeros(1, 1, S, D, dtype=torch.int8)
    k[..., 0], v[:] = 127, 127
    v[..., 1234, :] = 0
    k_pos, v_pos = torch.zeros(1, 1, S), torch.full((1, 1, S), 1 / 127)
    k_pos[..., 1234] = 11.2 / 127
    ones = torch.ones(1, D)
    out = decode_attention(q, k, v, 1.0, ones, ones, k_pos, v_pos)
    small = (S - 1) * torch.tensor(-11.2).double().exp()
    exact = torch.ones(D).double() * small / (1 + small)
    bound = exact.abs() * 2.0 ** -8 + 2.0 ** -12  # a bf16 rounding, plus the weights' fixed point against |v| <= 1
    assert float(((out[0, 0, 0].double() - exact).abs() / bound).max()) <= 1.0
