"""The attention entry point against its plain-torch definition, for every mask shape the model builds."""

import contextlib
import importlib

import pytest
import torch

from qinfer.kernels import attention_cpu, cpu_library
from qinfer.kernels.attention import _key_spans, attention, attention_ref

# the module itself (qinfer.kernels re-exports its function under the same name)
attention_module = importlib.import_module("qinfer.kernels.attention")


def _qkv(T, S, heads=4, kv_heads=2, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(T * 1000 + S)
    q = torch.randn(2, heads, T, D, generator=g, dtype=dtype)
    k = torch.randn(2, kv_heads, S, D, generator=g, dtype=dtype)
    v = torch.randn(2, kv_heads, S, D, generator=g, dtype=dtype)
    return q, k, v


def _mask(T, S, window=None):
    q_pos = torch.arange(S - T, S)[:, None]  # the T newest of S positions
    k_pos = torch.arange(S)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (q_pos - k_pos < window)


@pytest.mark.parametrize(
    "T, S, window",
    [
        (12, 12, None),  # prefill from position 0: a plain causal mask
        (12, 12, 5),  # sliding window shorter than the prompt
        (12, 12, 64),  # sliding window longer than the prompt: causal again
        (5, 12, None),  # prefill of a later chunk against cached keys
        (1, 12, None),  # decode step that sees every key
        (1, 12, 4),  # decode step under a sliding window
    ],
)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_reference(T, S, window, kv_heads):
    q, k, v = _qkv(T, S, kv_heads=kv_heads)
    mask = _mask(T, S, window)
    torch.testing.assert_close(attention(q, k, v, mask, 0.25), attention_ref(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, S", [(1, 12), (1, 300), (5, 12)])
def test_no_mask_means_every_key_is_seen(T, S):
    # the model passes no mask for a decode step (its one query sees every key it is handed)
    q, k, v = _qkv(T, S)
    everything = torch.ones(T, S, dtype=torch.bool)
    expected = attention_ref(q, k, v, everything, 0.25)
    torch.testing.assert_close(attention_ref(q, k, v, None, 0.25), expected, rtol=0, atol=0)
    torch.testing.assert_close(attention(q, k, v, None, 0.25), expected, rtol=1e-5, atol=1e-5)


def test_causal_fast_path_is_not_taken_for_other_square_masks():
    q, k, v = _qkv(8, 8)
    mask = _mask(8, 8)
    mask[5, 2] = False  # causal except one pair: must not be treated as causal
    out = attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, attention_ref(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, attention(q, k, v, _mask(8, 8), 0.25))


@pytest.mark.parametrize(
    "T, S, window",
    [
        (40, 40, 6),  # a prompt ten chunks long under a short window
        (13, 40, 6),  # a later prefill chunk against cached keys, rows not a multiple of the chunk
        (1, 40, 6),  # a decode step: only the window's keys are read
        (40, 40, 9),  # window not a multiple of the chunk
    ],
)
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_banded_masks_run_in_chunks_and_match_reference(monkeypatch, T, S, window, kv_heads):
    monkeypatch.setattr(attention_module, "CHUNK", 4)
    q, k, v = _qkv(T, S, kv_heads=kv_heads)
    mask = _mask(T, S, window)
    assert _key_spans(mask) is not None  # the chunked path is the one under test
    torch.testing.assert_close(attention(q, k, v, mask, 0.25), attention_ref(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)


def test_banded_chunks_carry_gradients(monkeypatch):
    # block tuning backpropagates through the attention
    monkeypatch.setattr(attention_module, "CHUNK", 4)
    q, k, v = (x.requires_grad_() for x in _qkv(24, 24, kv_heads=2))
    mask = _mask(24, 24, 5)
    grads = torch.autograd.grad(attention(q, k, v, mask, 0.25).square().sum(), (q, k, v))
    ref = torch.autograd.grad(attention_ref(q, k, v, mask, 0.25).square().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_key_spans(monkeypatch):
    monkeypatch.setattr(attention_module, "CHUNK", 4)
    # each chunk of 4 rows sees the keys from its first row's window start to its last row
    assert _key_spans(_mask(12, 12, 3)) == [(0, 4, 0, 4), (4, 8, 2, 8), (8, 12, 6, 12)]
    assert _key_spans(_mask(1, 12, 3)) == [(0, 1, 9, 12)]
    assert _key_spans(_mask(12, 12)) is None  # causal: chunking would not halve the products
    assert _key_spans(_mask(12, 12, 8)) is None  # a window this wide neither
    blind = _mask(12, 12, 3)
    blind[4:8] = False  # rows that see no key are left to SDPA whole
    assert _key_spans(blind) is None


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("c_loop", [True, False])
def test_decode_step_over_a_long_cache(kv_heads, dtype, tol, c_loop):
    # one query row seeing every key: the C loop on CPU, else grouped fp32 matmuls, each query head against
    # its own KV head
    q, k, v = _qkv(1, 300, kv_heads=kv_heads, dtype=dtype)
    mask = _mask(1, 300)
    with cpu_library.only_gemvs() if not c_loop else contextlib.nullcontext():
        assert attention_cpu.attention_supported(q, k, v) == (c_loop and cpu_library.available())
        out = attention(q, k, v, mask, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out, attention_ref(q, k, v, mask, 0.25), rtol=tol, atol=tol)


def test_decode_past_the_size_limit_uses_sdpa_and_matches(monkeypatch):
    monkeypatch.setattr(attention_module, "DECODE_MATMUL_MAX", 8)
    q, k, v = _qkv(1, 12, kv_heads=2)
    mask = _mask(1, 12)
    with cpu_library.only_gemvs():
        out = attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, attention_ref(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C kernels here: {cpu_library.unavailable_reason()}")
# query heads per KV head 4, 4, 1, 2, 3 (SmolLM2's), 6 (four and two): the C loop takes up to four at a time;
# D = 24 and 40 leave 8 columns past its blocks of 16
@pytest.mark.parametrize(
    "heads,kv_heads,D", [(4, 1, 256), (8, 2, 64), (4, 4, 16), (2, 1, 24), (9, 3, 64), (6, 1, 40)]
)
@pytest.mark.parametrize("S", [1, 7, 513, 3000])  # one chunk of keys, two (one a thread), three of 1000
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_c_decode_step_over_a_cache_slice_matches_the_exact_attention(heads, kv_heads, D, S, dtype):
    # keys and values as the KV cache hands them over: a slice of a longer [B, Hkv, S_max, D] buffer
    g = torch.Generator().manual_seed(S * D + heads)
    q = torch.randn(2, 1, heads * D, generator=g).to(dtype).view(2, 1, heads, D).transpose(1, 2)
    cache_k, cache_v = (torch.randn(2, kv_heads, S + 9, D, generator=g).to(dtype) for _ in range(2))
    k, v = cache_k[:, :, 5 : 5 + S], cache_v[:, :, 5 : 5 + S]
    assert attention_cpu.attention_supported(q, k, v)
    got = attention(q, k, v, None, D**-0.5)
    group = heads // kv_heads
    scores = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) * D**-0.5
    exact = scores.softmax(-1) @ v.double().repeat_interleave(group, 1)
    assert got.dtype == dtype and got.shape == (2, heads, 1, D)
    # one output rounding plus fp32 sums' error (the output is a weighted mean of rows of v, |v| < ~5)
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    bound = exact.abs() * rounding + 1e-5
    assert float(((got.double() - exact).abs() / bound).max()) <= 1.0


def _codes(x: torch.Tensor, kv_dtype: torch.dtype, per: str = "channel") -> tuple[torch.Tensor, tuple]:
    """x [B, Hkv, S, D] as a quantized KV cache stores it: codes and their scales, one per KV head and channel
    [Hkv, D] (as calibration stores them) or one per KV head [Hkv] (as a compressed-tensors import has them);
    "position": per KV head and channel, and per position and KV head [B, Hkv, S] (as the cache sets them)."""
    qmax = 127.0 if kv_dtype == torch.int8 else 448.0
    scale = x.abs().amax(dim=(0, 2, 3) if per == "head" else (0, 2)) / qmax
    y = x / scale.reshape(1, x.shape[1], 1, -1)
    scales = (scale,)
    if per == "position":
        pos = y.abs().amax(dim=-1) / qmax
        y, scales = y / pos[..., None], (scale, pos)
    y = y.clamp(-qmax, qmax)
    return (y.round().to(torch.int8) if kv_dtype == torch.int8 else y.to(kv_dtype)), scales


def _dequantized(codes: torch.Tensor, scales: tuple) -> torch.Tensor:
    x = codes.double() * scales[0].double().reshape(1, codes.shape[1], 1, -1)
    return x * scales[1].double()[..., None] if len(scales) > 1 else x


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C kernels here: {cpu_library.unavailable_reason()}")
@pytest.mark.parametrize("heads,kv_heads,D", [(4, 1, 256), (9, 3, 64), (4, 4, 16), (6, 1, 40)])
@pytest.mark.parametrize("S", [1, 513, 3000])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per", ["channel", "head", "position"])
def test_c_decode_step_over_quantized_codes_matches_the_exact_attention(heads, kv_heads, D, S, kv_dtype, dtype, per):
    # a quantized cache's slice of codes, with scales per KV head and channel (or per head), and maybe per
    # position: the loop folds the scales into the queries, its scores and its sums, and must give the exact
    # attention over the dequantized keys and values, to one output rounding; the channels' ranges differ (as
    # outlier channels make them), and so do the positions'
    g = torch.Generator().manual_seed(S * D + heads)
    q = torch.randn(2, heads, 1, D, generator=g).to(dtype)
    ranges = torch.rand(D, generator=g) * 4 + 0.1
    spread = torch.rand(S + 9, 1, generator=g) * 3 + 0.25  # [S, 1]: each position's own range
    (cache_k, k_scales), (cache_v, v_scales) = (
        _codes(torch.randn(2, kv_heads, S + 9, D, generator=g) * ranges * spread * (1 + i), kv_dtype, per)
        for i in range(2))
    k, v = cache_k[:, :, 5 : 5 + S], cache_v[:, :, 5 : 5 + S]
    k_scales, v_scales = ((x[0], *(p[:, :, 5 : 5 + S] for p in x[1:])) for x in (k_scales, v_scales))
    assert attention_cpu.attention_supported(q, k, v, quantized=True)
    assert not attention_cpu.attention_supported(q, k, v)
    with cpu_library.attention_without_vnni():  # the fp32 loop (the integer one: test_paged_attention.py)
        got = attention(q, k, v, None, D**-0.5, (k_scales[0], v_scales[0], *k_scales[1:], *v_scales[1:]))
    group = heads // kv_heads
    keys, values = _dequantized(k, k_scales), _dequantized(v, v_scales)
    scores = (q.double() @ keys.repeat_interleave(group, 1).transpose(-1, -2)) * D**-0.5
    exact = scores.softmax(-1) @ values.repeat_interleave(group, 1)
    assert got.dtype == dtype and got.shape == (2, heads, 1, D)
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}[dtype]
    bound = exact.abs() * rounding + 2e-6 * values.abs().amax()  # plus fp32 sums' error, relative to the values
    assert float(((got.double() - exact).abs() / bound).max()) <= 1.0


@pytest.mark.parametrize("T, S, window", [(12, 12, None), (5, 12, 4), (1, 12, 4), (1, 12, None)])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("per", ["channel", "head", "position"])
def test_quantized_codes_attend_as_their_dequantized_values(T, S, window, kv_dtype, per):
    # every path (prefill, a chunk under a window, a windowed or a full decode step; eager, profiled, and a
    # compiled decode step) attends over codes * scale (* the position's scale)
    q, k, v = _qkv(T, S, kv_heads=2, D=16)
    (k, k_scales), (v, v_scales) = _codes(k, kv_dtype, per), _codes(v, kv_dtype, per)
    scales = (k_scales[0], v_scales[0], *k_scales[1:], *v_scales[1:])
    mask = _mask(T, S, window)
    ref = attention_ref(q, _dequantized(k, k_scales).to(q.dtype), _dequantized(v, v_scales).to(q.dtype), mask, 0.25)
    torch.testing.assert_close(attention(q, k, v, mask, 0.25, scales), ref, rtol=1e-5, atol=1e-5)
    with torch.profiler.profile():
        torch.testing.assert_close(attention(q, k, v, mask, 0.25, scales), ref, rtol=1e-5, atol=1e-5)
    if T == 1 and window is None:  # as generate --compile's decode step: no mask
        f = torch.compile(lambda *a: attention(*a, None, 0.25, scales), fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(f(q, k, v), ref, rtol=1e-5, atol=1e-5)
    if T == 1 and window is None and cpu_library.available() and kv_dtype == torch.int8:  # (opcheck compares
        # its inputs before and after, which float8 tensors cannot do)
        torch.library.opcheck(torch.ops.qinfer.decode_attention.default, (q, k, v, 0.25, *scales))


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C kernels here: {cpu_library.unavailable_reason()}")
@pytest.mark.parametrize("spread", [1.0, 30.0, 300.0])
def test_c_decode_step_softmax_over_scores_far_apart(spread):
    # scores from -spread^2 to +spread^2: the exponentials of most underflow (past e^-87) and the weights
    # fall on a few keys; the output stays the exact attention's to fp32 rounding
    g = torch.Generator().manual_seed(int(spread))
    q = torch.randn(1, 4, 1, 32, generator=g) * spread
    k, v = torch.randn(1, 1, 200, 32, generator=g) * spread, torch.randn(1, 1, 200, 32, generator=g)
    got = attention(q, k, v, None, 32**-0.5)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 32**-0.5
    exact = scores.softmax(-1) @ v.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C kernels here: {cpu_library.unavailable_reason()}")
def test_c_decode_step_takes_only_what_it_can():
    q, k, v = _qkv(1, 12, kv_heads=2, D=16)
    assert attention_cpu.attention_supported(q, k, v)
    assert not attention_cpu.attention_supported(*_qkv(2, 12, kv_heads=2, D=16))  # two query rows: SDPA
    assert not attention_cpu.attention_supported(q, k, v.bfloat16())  # dtypes differ
    assert not attention_cpu.attention_supported(*_qkv(1, 12, kv_heads=2, D=12))  # D not a multiple of 8
    assert not attention_cpu.attention_supported(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)  # D apart
    assert not attention_cpu.attention_supported(q.clone().requires_grad_(), k, v)
    f = torch.compile(lambda q, k, v: attention(q, k, v, None, 0.25), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q, k, v), attention_ref(q, k, v, None, 0.25), rtol=1e-5, atol=1e-5)  # traced: torch
    with torch.profiler.profile() as prof:
        out = attention(q, k, v, None, 0.25)
    assert "qinfer::decode_attention" in {e.name for e in prof.events()}
    torch.testing.assert_close(out, attention_ref(q, k, v, None, 0.25), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.qinfer.decode_attention.default, (q, k[:, :, 2:], v[:, :, 2:], 0.25))


@pytest.mark.parametrize("rows", [1, 3, 7, 100])
def test_causal_check_in_blocks_of_rows(rows):
    # the check compares a block of rows at a time; any block size gives the whole comparison's answer
    T = 10
    causal = _mask(T, T)
    assert attention_module._is_causal(causal, rows)
    for i, j in ((0, 1), (4, 2), (9, 9), (6, 7), (3, 0)):
        other = causal.clone()
        other[i, j] = not other[i, j]
        assert not attention_module._is_causal(other, rows)
    assert not attention_module._is_causal(_mask(T, T, window=4), rows)


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C kernels here: {cpu_library.unavailable_reason()}")
def test_c_decode_step_refuses_position_scales_of_another_shape():
    # the loop reads S scales per (batch, KV head) for keys and for values: a wrong shape would read past them
    q, k, v = _qkv(1, 12, kv_heads=2, D=16)
    (k, (k_scale, k_pos)), (v, (v_scale, v_pos)) = _codes(k, torch.int8, "position"), _codes(v, torch.int8, "position")
    for bad in ((k_pos, None), (k_pos[:, :, :5], v_pos[:, :, :5]), (k_pos, v_pos[:, :1])):
        with pytest.raises(ValueError, match=r"k_pos and v_pos must both be \[B, Hkv, S\]"):
            attention_cpu.decode_attention(q, k, v, 0.25, k_scale, v_scale, *bad)
