"""The packed format: exact round trips, the documented bit positions, scheme validation and JSON."""

import dataclasses
import math

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.format import (
    FORMAT_VERSION,
    QUANT_CONFIG_FILE,
    Fp8Weight,
    QuantizedWeight,
    QuantScheme,
    dequantize_codes,
    effective_bits,
    pack,
    unpack,
)
from qinfer.quantizers.fp8 import fp8_quantize
from qinfer.quantizers.rtn import rtn_quantize


def _u8(rows):
    return torch.tensor(rows, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------- packing

# K values per width: the smallest legal K, a K that is not a multiple of 8 where the width allows one
# (exercises the padding of the 8-code words), and a larger odd multiple.
PACK_CASES = [(b, K) for b in range(1, 9) for K in sorted({8 // math.gcd(8, b) * m for m in (1, 3, 37)})]


@pytest.mark.parametrize("bits,K", PACK_CASES)
def test_pack_unpack_round_trip_is_exact(bits, K):
    g = torch.Generator().manual_seed(bits * 1000 + K)
    codes = torch.randint(0, 1 << bits, (5, K), generator=g, dtype=torch.uint8)
    codes[0] = (1 << bits) - 1  # every bit set: catches sign extension and overlapping shifts
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, K * bits // 8)
    assert torch.equal(unpack(packed, bits, K), codes)


def test_pack_odd_K_round_trips_at_8_bits_and_is_refused_below():
    codes = torch.randint(0, 256, (3, 7), dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, 8), 8, 7), codes)
    for bits in (2, 3, 4):
        with pytest.raises(QinferError, match="whole bytes"):
            pack(codes, bits)


def test_pack_accepts_leading_dims():
    codes = torch.randint(0, 8, (2, 3, 16), dtype=torch.uint8)
    packed = pack(codes, 3)
    assert packed.shape == (2, 3, 6)
    assert torch.equal(unpack(packed, 3, 16), codes)
    assert torch.equal(packed[1, 2], pack(codes[1, 2:3], 3)[0])


def test_documented_bit_positions():
    # 4 bits: low nibble holds the even k.
    assert torch.equal(pack(_u8([[1, 2]]), 4), _u8([[0x21]]))
    assert torch.equal(pack(_u8([[0xF, 0x0, 0x3, 0xC]]), 4), _u8([[0x0F, 0xC3]]))
    # 2 bits: q0 | q1 << 2 | q2 << 4 | q3 << 6 = 1 | 8 | 48 | 0.
    assert torch.equal(pack(_u8([[1, 2, 3, 0]]), 2), _u8([[0b00111001]]))
    # 3 bits, stream written out by hand (stream bit i is bit i % 8 of byte i // 8):
    #   q = 5 3 6 1 7 2 4 0 -> bits 0..23 = 101 110 011 100 111 010 001 000 (LSB first per code)
    #   byte0 = bits 0-7   = 1,0,1,1,1,0,0,1 -> 0b10011101 = 0x9D
    #   byte1 = bits 8-15  = 1,1,0,0,1,1,1,0 -> 0b01110011 = 0x73
    #   byte2 = bits 16-23 = 1,0,0,0,1,0,0,0 -> 0b00010001 = 0x11
    q3 = _u8([[5, 3, 6, 1, 7, 2, 4, 0]])
    assert torch.equal(pack(q3, 3), _u8([[0x9D, 0x73, 0x11]]))
    # and the spec's per-byte formulas say the same
    q = [int(v) for v in q3[0]]
    assert (q[0] | q[1] << 3 | (q[2] & 3) << 6) == 0x9D
    assert (q[2] >> 2 | q[3] << 1 | q[4] << 4 | (q[5] & 1) << 7) == 0x73
    assert (q[5] >> 1 | q[6] << 2 | q[7] << 5) == 0x11
    assert torch.equal(pack(_u8([[7, 200]]), 8), _u8([[7, 200]]))


def test_pack_errors():
    with pytest.raises(QinferError, match="uint8"):
        pack(torch.zeros(1, 8, dtype=torch.int32), 4)
    with pytest.raises(QinferError, match="bits"):
        pack(torch.zeros(1, 8, dtype=torch.uint8), 9)
    with pytest.raises(QinferError, match="do not hold"):
        unpack(torch.zeros(1, 3, dtype=torch.uint8), 4, 8)


# ---------------------------------------------------------------------------------------------- scheme


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="bnb"), "method"),
        (dict(bits=5), "bits"),
        (dict(bits=True), "bits"),
        (dict(bits="4"), "bits"),
        (dict(group_size=48), "group_size"),
        (dict(symmetric="yes"), "symmetric"),
        (dict(kv_cache="fp16"), "kv_cache"),
        (dict(damp=0.0), "damp"),
        (dict(damp=float("nan")), "damp"),
        (dict(lm_head_bits=16), "lm_head_bits"),
        (dict(act_order=True), "act_order \\(--act-order\\) applies only to --method gptq"),
        (dict(method="fp8"), "method 'fp8' with format 'int'"),
        (dict(method="awq", format="fp8", bits=8, group_size=-1), "format 'fp8' goes with method 'fp8'"),
        (dict(method="fp8", format="fp8", bits=4, group_size=-1), r"bits \(--bits\) must be 8; got 4 \(fp8 E4M3 weights are 8 bits: use --bits 8"),
        (dict(method="fp8", format="fp8", bits=8.0, group_size=-1), r"bits \(--bits\) must be 8; got 8.0 \(fp8 E4M3"),
        (dict(method="fp8", format="fp8", bits=8, group_size=-1, lm_head_bits=4), r"lm_head_bits \(--lm-head-bits\) must be 8; got 4 \(fp8 E4M3"),
        (dict(method="fp8", format="fp8", bits=8, group_size=128), "fp8 has no groups"),
        (dict(method="fp8", format="fp8", bits=8, group_size=-1, symmetric=False), "symmetric"),
        (dict(method="fp8", format="fp8", bits=8, group_size=-1, fp8_granularity="block"), "fp8_granularity"),
        (dict(method="fp8", format="fp8", bits=8, group_size=-1, mse_clip=True), "clip search"),
        (dict(mse_clip=1), "mse_clip"),
        (dict(bits=5), r"^bits \(--bits\) must be one of 2, 3, 4, 8; got 5"),
        (dict(group_size=48), r"^group_size \(--group-size\) must be one of 32, 64, 128, -1; got 48"),
    ],
)
def test_scheme_validation(kwargs, match):
    with pytest.raises(QinferError, match=match):
        QuantScheme(**kwargs)


SCHEMES = [
    QuantScheme(),
    QuantScheme(method="gptq", bits=3, group_size=-1, symmetric=False, act_order=True, damp=0.1, kv_cache="int8"),
    QuantScheme(method="awq", bits=4, group_size=64, quantize_lm_head=True, lm_head_bits=4),
    QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1, fp8_granularity="tensor", kv_cache="fp8"),
]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_json_round_trip(scheme, tmp_path):
    assert QuantScheme.from_json(scheme.to_json()) == scheme
    path = scheme.save(tmp_path)
    assert path.name == QUANT_CONFIG_FILE
    assert QuantScheme.load(tmp_path) == scheme
    assert f'"format_version": {FORMAT_VERSION}' in path.read_text()


def test_scheme_is_frozen_and_lm_head_scheme():
    s = QuantScheme(bits=4, lm_head_bits=8, quantize_lm_head=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.bits = 3
    assert s.lm_head_scheme() == dataclasses.replace(s, bits=8)
    assert s.maxq == 15


def test_scheme_from_json_errors(tmp_path):
    good = QuantScheme().to_json()
    with pytest.raises(QinferError, match="format_version"):
        QuantScheme.from_json(good.replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99'))
    with pytest.raises(QinferError, match="unknown keys"):
        QuantScheme.from_json(good.replace('"bits"', '"bitz"'))
    with pytest.raises(QinferError, match=r"not valid JSON \(.*\): the folder is damaged; quantize the model again"):
        QuantScheme.from_json("{")
    with pytest.raises(QinferError, match=r"^quant_config.json is damaged: bits \(--bits\) must be one of 2, 3, 4, 8; "
                                          r"got 5; quantize the model again$"):
        QuantScheme.from_json(good.replace('"bits": 4', '"bits": 5'))
    with pytest.raises(QinferError, match="not found"):
        QuantScheme.load(tmp_path)
    # JSON writers may drop the ".0" of a float; damp stays a float
    assert QuantScheme.from_json(good.replace('"damp": 0.01', '"damp": 1')).damp == 1.0
    # quant_config.json written before the clip search existed has no mse_clip: it was off
    older = good.replace(',\n  "mse_clip": false', '')
    assert "mse_clip" not in older and QuantScheme.from_json(older) == QuantScheme()


# ---------------------------------------------------------------------------------------------- weights


def test_dequantize_follows_the_formula():
    # per channel, asymmetric: w = (q - zero) * scale
    codes = _u8([[0, 15, 8, 9], [1, 2, 3, 4]])
    w = QuantizedWeight(pack(codes, 4), torch.tensor([[0.5], [2.0]]).half(), _u8([[8], [0]]), 4, -1, (2, 4))
    assert torch.equal(w.dequantize(torch.float32), torch.tensor([[-4.0, 3.5, 0.0, 0.5], [2.0, 4.0, 6.0, 8.0]]))
    # grouped, symmetric (implicit zero 2^(b-1) = 4 at 3 bits), checked element by element against g(k) = k // G
    g = torch.Generator().manual_seed(0)
    N, K, G = 3, 64, 32
    codes = torch.randint(0, 8, (N, K), generator=g, dtype=torch.uint8)
    scale = (torch.rand(N, K // G, generator=g) + 0.1).half()
    w = QuantizedWeight(pack(codes, 3), scale, None, 3, G, (N, K)).dequantize(torch.float32)
    for n, k in [(0, 0), (1, 31), (2, 32), (2, 63)]:
        assert w[n, k].item() == (int(codes[n, k]) - 4) * float(scale[n, k // G])


def test_dequantize_codes_leaves_its_inputs_alone_and_passes_gradients():
    # it works in place on its own fp32 copy: float codes (the tuning stage's levels) must come back
    # unchanged, and the gradients are those of (q - z) * s written out per element
    g = torch.Generator().manual_seed(2)
    levels = torch.randint(0, 16, (4, 64), generator=g).float().requires_grad_()
    scale = (torch.rand(4, 2, generator=g) + 0.1).requires_grad_()
    zero = torch.randint(0, 16, (4, 2), generator=g).float()
    before = levels.detach().clone()
    w = dequantize_codes(levels, scale, zero, 32)
    weights = torch.rand(4, 64, generator=g)
    (w * weights).sum().backward()
    assert torch.equal(levels.detach(), before)
    group = torch.arange(64) // 32
    assert torch.equal(w.detach(), (before - zero[:, group]) * scale.detach()[:, group])
    torch.testing.assert_close(levels.grad, weights * scale.detach()[:, group])
    torch.testing.assert_close(scale.grad, ((before - zero[:, group]) * weights).view(4, 2, 32).sum(-1))


@pytest.mark.parametrize("scheme", [SCHEMES[0], SCHEMES[1], SCHEMES[2].lm_head_scheme()])
def test_int_tensors_round_trip(scheme):
    W = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    qw = rtn_quantize(W, scheme)
    entries = qw.tensors("model.layers.0.mlp.up_proj")
    expected = {"qweight", "scale"} | ({"zero"} if not scheme.symmetric else set())
    assert {k.rsplit(".", 1)[1] for k in entries} == expected
    back = QuantizedWeight.from_tensors("model.layers.0.mlp.up_proj", entries, scheme)
    assert back.shape == (8, 128) and back.bits == scheme.bits and back.group_size == scheme.group_size
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert torch.equal(back.to("cpu").codes(), qw.codes())


@pytest.mark.parametrize("scheme", SCHEMES + [QuantScheme(bits=2, group_size=32, symmetric=False)])
def test_rows_are_the_dequantized_rows(scheme):
    # a tied embedding looks its rows up from the packed lm_head: the same numbers as dequantizing it whole
    W = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    qw = (fp8_quantize if scheme.format == "fp8" else rtn_quantize)(W, scheme)
    index = torch.tensor([[3, 0, 15], [3, 7, 1]])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(qw.rows(index, dtype), qw.dequantize(dtype)[index])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_a_zero_point_past_the_codes_range_is_refused(bits):
    scheme = QuantScheme(bits=bits, group_size=32, symmetric=False)
    entries = rtn_quantize(torch.randn(8, 128, generator=torch.Generator().manual_seed(6)), scheme).tensors("p")
    top = entries["p.zero"].clone()
    top[0, 0] = (1 << bits) - 1  # the largest code is a zero point an asymmetric grid can have
    QuantizedWeight.from_tensors("p", {**entries, "p.zero": top}, scheme)
    top[0, 0] = 1 << bits
    with pytest.raises(QinferError, match=rf"p.zero: a zero point of {1 << bits} is past the {bits}-bit codes"):
        QuantizedWeight.from_tensors("p", {**entries, "p.zero": top}, scheme)


def test_permuted_columns_round_trip_and_are_checked():
    W = torch.randn(8, 128, generator=torch.Generator().manual_seed(4))
    scheme = QuantScheme(bits=4, group_size=32, symmetric=False)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    qw = dataclasses.replace(rtn_quantize(W, scheme), perm=perm)
    entries = qw.tensors("p")
    assert torch.equal(entries["p.perm"], perm)
    back = QuantizedWeight.from_tensors("p", entries, scheme)
    assert torch.equal(back.dequantize(torch.float32), qw.dequantize(torch.float32))
    codes, scale, zero = qw.codes().float(), qw.scale.float(), qw.zero.float()
    for n, j in [(0, 0), (3, 31), (7, 32), (5, 127)]:  # w[n, perm[j]] = (q[n, j] - zero[n, j // G]) * scale[n, j // G]
        want = (codes[n, j] - zero[n, j // 32]) * scale[n, j // 32]
        assert qw.dequantize(torch.float32)[n, int(perm[j])].item() == want.item()
    index = torch.tensor([[1, 6], [0, 0]])
    assert torch.equal(qw.rows(index, torch.float32), qw.dequantize(torch.float32)[index])
    with pytest.raises(QinferError, match="not a permutation"):
        QuantizedWeight.from_tensors("p", {**entries, "p.perm": torch.zeros(128, dtype=torch.int32)}, scheme)
    with pytest.raises(QinferError, match="perm: expected torch.int32"):
        QuantizedWeight.from_tensors("p", {**entries, "p.perm": perm.long()}, scheme)


def test_from_tensors_errors():
    sym, asym = QuantScheme(), QuantScheme(symmetric=False)
    W = torch.randn(4, 256)
    entries = rtn_quantize(W, asym).tensors("p")
    with pytest.raises(QinferError, match="present but the scheme is symmetric"):
        QuantizedWeight.from_tensors("p", entries, sym)
    with pytest.raises(QinferError, match="missing tensor 'p.zero'"):
        QuantizedWeight.from_tensors("p", rtn_quantize(W, sym).tensors("p"), asym)
    with pytest.raises(QinferError, match=r"p: scale: expected torch.float16 \[4, 1\]"):
        QuantizedWeight.from_tensors("p", entries, QuantScheme(symmetric=False, group_size=-1))



@pytest.mark.parametrize("bad,word", [(float("nan"), "NaN"), (float("inf"), "infinite"), (-0.5, "negative")])
def test_scales_that_are_not_finite_and_non_negative_are_refused(bad, word):
    # a corrupt scale would run (NaN logits, exit 0); 0 is a group of zeros and stays readable
    W = torch.randn(4, 256)
    scheme = QuantScheme(symmetric=False)
    entries = rtn_quantize(W, scheme).tensors("p")
    entries["p.scale"][2, 1] = bad
    with pytest.raises(QinferError, match=f"^p.scale holds {word} scales: the checkpoint is corrupt"):
        QuantizedWeight.from_tensors("p", entries, scheme)
    entries["p.scale"][2, 1] = 0
    assert QuantizedWeight.from_tensors("p", entries, scheme).dequantize()[2, 128:].eq(0).all()
    fp8 = QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1)
    entries = fp8_quantize(W, fp8).tensors("p")
    entries["p.scale"][1, 0] = bad
    with pytest.raises(QinferError, match=f"^p.scale holds {word} scales"):
        Fp8Weight.from_tensors("p", entries, fp8)

def test_fp8_scales_whose_weights_overflow_float32_are_refused_and_the_writers_largest_is_read():
    fp8 = QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1)
    top = torch.finfo(torch.float32).max
    written = fp8_quantize(torch.tensor([[top, -top / 3, 0.0, 1.0]]), fp8)  # the largest scale a writer makes
    back = Fp8Weight.from_tensors("p", written.tensors("p"), fp8).dequantize(torch.float32)
    assert back.isfinite().all() and back[0, 2] == 0
    entries = written.tensors("p")
    entries["p.scale"] = torch.tensor([[1.4e36]])  # code 1.0 times it: finite in the spec, inf and NaN if run
    with pytest.raises(QinferError, match="^p.scale holds scales past 7.6e\\+35, whose weights overflow float32"):
        Fp8Weight.from_tensors("p", entries, fp8)


def test_an_empty_weight_is_refused():
    with pytest.raises(QinferError, match=r"^p: QuantizedWeight: a weight of shape \(4, 0\) has no elements"):
        QuantizedWeight.from_tensors("p", {"p.qweight": torch.zeros(4, 0, dtype=torch.uint8),
                                           "p.scale": torch.zeros(4, 0, dtype=torch.float16)},
                                     QuantScheme(group_size=-1))
    with pytest.raises(QinferError, match="has no elements"):
        rtn_quantize(torch.zeros(4, 0), QuantScheme(group_size=-1))


def test_fp8_tensors_round_trip_and_granularity_check():
    W = torch.randn(8, 40)
    for gran in ("channel", "tensor"):
        scheme = QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1, fp8_granularity=gran)
        fw = fp8_quantize(W, scheme)
        assert fw.scale.shape == ((8, 1) if gran == "channel" else (1,))
        back = Fp8Weight.from_tensors("p", fw.tensors("p"), scheme)
        assert torch.equal(back.dequantize(torch.float32), fw.dequantize(torch.float32))
        other = dataclasses.replace(scheme, fp8_granularity="tensor" if gran == "channel" else "channel")
        with pytest.raises(QinferError, match="fp8_granularity"):
            Fp8Weight.from_tensors("p", fw.tensors("p"), other)


@pytest.mark.parametrize("scheme", SCHEMES + [QuantScheme(bits=4, group_size=128, symmetric=False)])
def test_effective_bits_counts_the_stored_bytes(scheme):
    N, K = 16, 256
    W = torch.randn(N, K)
    stored = (fp8_quantize if scheme.format == "fp8" else rtn_quantize)(W, scheme).tensors("p")
    nbits = 8 * sum(t.numel() * t.element_size() for t in stored.values())
    assert effective_bits(scheme, (N, K)) == nbits / (N * K)


def test_effective_bits_examples():
    assert effective_bits(QuantScheme(bits=4, group_size=128), (4096, 4096)) == 4.125
    assert effective_bits(QuantScheme(bits=4, group_size=128, symmetric=False), (4096, 4096)) == 4.1875
    assert effective_bits(QuantScheme(bits=3, group_size=-1), (4096, 4096)) == 3 + 16 / 4096


@pytest.mark.parametrize("scheme, tag", [
    (QuantScheme(method="gptq", bits=4, group_size=128, act_order=True), "gptq-w4g128"),
    (QuantScheme(method="awq", bits=3, group_size=-1), "awq-w3"),
    (QuantScheme(method="fp8", bits=8, group_size=-1, format="fp8", lm_head_bits=8), "fp8"),
    (QuantScheme(method="gptq", bits=8, group_size=-1, format="fp8"), "gptq-fp8"),
])
def test_a_scheme_tag_names_method_bits_and_group(scheme, tag):
    assert scheme.tag == tag
