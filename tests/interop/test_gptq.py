"""The GPTQ v1 converter is checked against a reader and a packer written here from AutoGPTQ's published
QuantLinear (pack loop, and the shift tables of its torch dequantization), element by element in Python
integers, not by inverting qinfer's own packing."""

from dataclasses import replace

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.format import QuantizedWeight, QuantScheme, pack
from qinfer.interop.gptq import from_gptq_tensors, gptq_quantization_config, scheme_from_gptq_config, to_gptq_tensors
from qinfer.kernels.linear import linear
from qinfer.quantizers.rtn import rtn_quantize


def _u32(x: int) -> int:
    return x & 0xFFFFFFFF


def _s32(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


def _read_packed(words: list[int], bits: int) -> list[int]:
    """Values of one packed line, read the way AutoGPTQ's dequantization does.

    2/4/8 bits: value j of word r is (word >> bits * j) & mask. 3 bits: per 3 words, shifts
    [0, 3, .., 27] then 30 in word 0, [1, 4, .., 28] then 31 in word 1, [2, 5, .., 29] in word 2, with the
    two straddling values completed from the low bits of the next word.
    """
    mask = (1 << bits) - 1
    words = [_u32(w) for w in words]
    out = []
    if bits in (2, 4, 8):
        for w in words:
            out += [(w >> (bits * j)) & mask for j in range(32 // bits)]
        return out
    assert bits == 3
    for i in range(0, len(words), 3):
        w0, w1, w2 = words[i : i + 3]
        out += [(w0 >> s) & 7 for s in range(0, 30, 3)]
        out.append(((w0 >> 30) & 0b11) | ((w1 & 1) << 2))
        out += [(w1 >> s) & 7 for s in range(1, 31, 3)]
        out.append(((w1 >> 31) & 1) | ((w2 & 0b11) << 1))
        out += [(w2 >> s) & 7 for s in range(2, 32, 3)]
    return out


def _write_packed(values: list[int], bits: int) -> list[int]:
    """AutoGPTQ's pack loop for one line: 32/bits values per word, or 32 values per 3 words at 3 bits."""
    words = []
    if bits in (2, 4, 8):
        per = 32 // bits
        for i in range(0, len(values), per):
            w = 0
            for j in range(per):
                w |= values[i + j] << (bits * j)
            words.append(_u32(w))
        return [_s32(w) for w in words]
    for i in range(0, len(values), 32):
        v = values[i : i + 32]
        w0 = sum(v[j] << (3 * j) for j in range(10)) | (v[10] << 30)
        w1 = (v[10] >> 2) & 1 | sum(v[11 + j] << (3 * j + 1) for j in range(10)) | (v[21] << 31)
        w2 = (v[21] >> 1) & 0b11 | sum(v[22 + j] << (3 * j + 2) for j in range(10))
        words += [_u32(w0), _u32(w1), _u32(w2)]
    return [_s32(w) for w in words]


def _reference_dequant(t: dict, prefix: str, bits: int) -> torch.Tensor:
    """w[n, k] = scales[g_idx[k], n] * (q[n, k] - (stored_zero[g_idx[k], n] + 1)), in float32."""
    qweight, qzeros = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"]
    scales, g_idx = t[f"{prefix}.scales"].float(), t[f"{prefix}.g_idx"].tolist()
    N = qweight.shape[1]
    cols = [_read_packed(qweight[:, n].tolist(), bits) for n in range(N)]  # q[n][k]
    zeros = [_read_packed(row, bits) for row in qzeros.tolist()]  # stored zero [g][n]
    K = len(cols[0])
    w = torch.empty(N, K)
    for n in range(N):
        for k in range(K):
            g = g_idx[k]
            w[n, k] = float(scales[g, n]) * (cols[n][k] - (zeros[g][n] + 1))
    return w


def _weight(N=64, K=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * torch.logspace(-2, 0, N)[:, None]


SCHEMES = [
    QuantScheme(method="gptq", bits=b, group_size=G, symmetric=sym)
    for b in (2, 3, 4, 8)
    for G in (32, -1)
    for sym in (True, False)
]


def _id(s):
    return f"b{s.bits}-g{s.group_size}-{'sym' if s.symmetric else 'asym'}"


def _quantize_without_zero_zero(W, scheme):
    """RTN, shifted per row so that no asymmetric group's zero point is 0 (GPTQ v1 cannot store it)."""
    W = W - W.abs().amax() * 0.05 if not scheme.symmetric else W
    W[:, ::7] = W[:, ::7].abs() * -1.0  # every group has a negative value, so its zero point is >= 1
    return rtn_quantize(W, scheme)


@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
def test_layout_matches_the_autogptq_reader(scheme):
    qw = _quantize_without_zero_zero(_weight(), scheme)
    t = to_gptq_tensors(qw, "model.layers.0.mlp.up_proj")
    N, K, b = 64, 128, scheme.bits
    n_g = 1 if scheme.group_size == -1 else K // scheme.group_size
    p = "model.layers.0.mlp.up_proj"
    assert set(t) == {f"{p}.qweight", f"{p}.qzeros", f"{p}.scales", f"{p}.g_idx"}
    assert t[f"{p}.qweight"].dtype == torch.int32 and t[f"{p}.qweight"].shape == (K * b // 32, N)
    assert t[f"{p}.qzeros"].dtype == torch.int32 and t[f"{p}.qzeros"].shape == (n_g, N * b // 32)
    assert t[f"{p}.scales"].dtype == torch.float16 and t[f"{p}.scales"].shape == (n_g, N)
    assert t[f"{p}.g_idx"].dtype == torch.int32 and t[f"{p}.g_idx"].tolist() == [k * n_g // K for k in range(K)]
    assert torch.equal(_reference_dequant(t, p, b), qw.dequantize(torch.float32))


@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
def test_round_trip_is_exact(scheme):
    qw = _quantize_without_zero_zero(_weight(N=96, K=256, seed=1), scheme)
    back = from_gptq_tensors("p", to_gptq_tensors(qw, "p"), scheme)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scale, qw.scale)
    assert (back.zero is None) == scheme.symmetric
    if not scheme.symmetric:
        assert torch.equal(back.zero, qw.zero)
    assert back.shape == qw.shape and back.group_size == qw.group_size and back.bits == qw.bits


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_import_of_an_autogptq_packed_checkpoint(bits):
    # Pack codes and zeros with the published loop (not qinfer's packer) and read them with qinfer.
    g = torch.Generator().manual_seed(bits)
    N, K, G = 32, 96, 32
    codes = torch.randint(0, 1 << bits, (N, K), generator=g)
    zeros = torch.randint(1, 1 << bits, (N, K // G), generator=g)  # real zeros, >= 1
    scales = (torch.rand(K // G, N, generator=g) + 0.01).half()
    qweight = torch.tensor([_write_packed(codes[n].tolist(), bits) for n in range(N)], dtype=torch.int32).T
    qzeros = torch.tensor([_write_packed((zeros[:, gi] - 1).tolist(), bits) for gi in range(K // G)], dtype=torch.int32)
    t = {"p.qweight": qweight.contiguous(), "p.qzeros": qzeros, "p.scales": scales, "p.g_idx": torch.arange(K) // G}
    qw = from_gptq_tensors("p", t, QuantScheme(method="gptq", bits=bits, group_size=G, symmetric=False))
    assert torch.equal(qw.codes(), codes.to(torch.uint8))
    assert torch.equal(qw.zero, zeros.to(torch.uint8))
    assert torch.equal(qw.scale, scales.T)
    t["p.g_idx"] = t["p.g_idx"].int()
    assert torch.equal(qw.dequantize(torch.float32), _reference_dequant(t, "p", bits))


@pytest.mark.parametrize("bits,symmetric", [(4, False), (3, True), (8, False)])
def test_act_order_checkpoint_without_static_groups(bits, symmetric):
    # AutoGPTQ's desc_act without static groups: channel k belongs to group rank(k) // G, where rank is its
    # place in the act order, and its codes stay in channel order. Packed with the published loop.
    g = torch.Generator().manual_seed(10 + bits)
    N, K, G = 32, 96, 32
    codes = torch.randint(0, 1 << bits, (N, K), generator=g)
    order = torch.randperm(K, generator=g)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // G).int()
    zeros = torch.full((N, K // G), 1 << (bits - 1)) if symmetric else torch.randint(1, 1 << bits, (N, K // G), generator=g)
    scales = (torch.rand(K // G, N, generator=g) + 0.01).half()
    qweight = torch.tensor([_write_packed(codes[n].tolist(), bits) for n in range(N)], dtype=torch.int32).T
    qzeros = torch.tensor([_write_packed((zeros[:, gi] - 1).tolist(), bits) for gi in range(K // G)], dtype=torch.int32)
    t = {"p.qweight": qweight.contiguous(), "p.qzeros": qzeros, "p.scales": scales, "p.g_idx": g_idx}
    scheme = QuantScheme(method="gptq", bits=bits, group_size=G, symmetric=symmetric, act_order=True)
    qw = from_gptq_tensors("p", t, scheme)
    assert qw.perm is not None
    assert torch.equal(qw.dequantize(torch.float32), _reference_dequant(t, "p", bits))
    x = torch.randn(3, K)
    expected = x @ _reference_dequant(t, "p", bits).T
    # (fp32 rows through the C kernels: within 1e-4 of the output's scale, as qinfer.kernels.gemv_cpu states)
    assert torch.allclose(linear(x, qw), expected, atol=1e-4 * float(expected.abs().max()))
    back = to_gptq_tensors(qw, "p")  # written back as it was read
    assert set(back) == set(t) and all(torch.equal(back[k], t[k]) for k in t)


def test_published_constants():
    # Symmetric v1 checkpoints store zero 2^(b-1) - 1 in every field: the familiar 0x77777777 at 4 bits.
    W = _weight(N=32, K=64)
    for bits, word in ((2, 0x55555555), (4, 0x77777777), (8, 0x7F7F7F7F)):
        qzeros = to_gptq_tensors(rtn_quantize(W, QuantScheme(bits=bits, group_size=32)), "p")["p.qzeros"]
        assert bool((qzeros == _s32(word)).all()), (bits, hex(_u32(int(qzeros[0, 0]))))
    # 3 bits: the value 3 (0b011) repeated through a 96-bit stream over 3 words
    qzeros = to_gptq_tensors(rtn_quantize(W, QuantScheme(bits=3, group_size=32)), "p")["p.qzeros"]
    stream = sum(3 << (3 * i) for i in range(32))
    assert qzeros[0].tolist() == [_s32((stream >> (32 * w)) & 0xFFFFFFFF) for w in range(3)]
    # 4-bit qweight: input channel k sits in word k // 8 at shift 4 * (k % 8)
    codes = torch.tensor([list(range(16)) + list(range(15, -1, -1))] * 32, dtype=torch.uint8)
    codes = torch.cat([codes, codes], dim=1)  # [32, 64]
    qw = QuantizedWeight(pack(codes, 4), torch.ones(32, 2).half(), None, 4, 32, (32, 64))
    col = to_gptq_tensors(qw, "p")["p.qweight"][:, 0].tolist()
    assert [_u32(w) for w in col[:4]] == [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567]


def test_config():
    scheme = QuantScheme(method="gptq", bits=4, group_size=128, symmetric=False, act_order=True, damp=0.05)
    cfg = gptq_quantization_config(scheme)
    assert cfg == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,  # static groups: g_idx is k // G
        "sym": False,
        "checkpoint_format": "gptq",
        "lm_head": False,
        "damp_percent": 0.05,
    }
    back = scheme_from_gptq_config(cfg)
    assert back == QuantScheme(method="gptq", bits=4, group_size=128, symmetric=False, damp=0.05)
    # a typical AutoGPTQ config (no checkpoint_format key, desc_act true)
    auto = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "damp_percent": 0.01}
    assert scheme_from_gptq_config(auto).act_order is True
    lm = QuantScheme(bits=3, group_size=-1, quantize_lm_head=True, lm_head_bits=3)
    assert scheme_from_gptq_config(gptq_quantization_config(lm)).lm_head_bits == 3
    assert "dynamic" not in gptq_quantization_config(lm)
    # an int8 lm_head beside 4-bit linears: GPTQModel's per-module override, which vLLM reads too
    head8 = gptq_quantization_config(QuantScheme(quantize_lm_head=True))
    assert head8["lm_head"] is True and head8["bits"] == 4 and head8["dynamic"] == {"+:^lm_head$": {"bits": 8}}
    back = scheme_from_gptq_config(head8)
    assert (back.bits, back.quantize_lm_head, back.lm_head_bits) == (4, True, 8)
    gptqmodel = {**auto, "lm_head": True, "dynamic": {"+:lm_head": {"bits": 8, "group_size": 128, "sym": True}}}
    assert scheme_from_gptq_config(gptqmodel).lm_head_bits == 8


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "not 'gptq'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "format v1"),
        # transformers 5 / GPTQModel's key for the same thing: a v2 checkpoint read as v1 is off by one zero point
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_v2"}, "format 'gptq_v2'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq", "checkpoint_format": "marlin"},
         "checkpoint_format 'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down_proj": {}}}, "'dynamic'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:.*down_proj": {"bits": 8}}},
         "'dynamic'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:^lm_head$": {"group_size": 32}}},
         "'dynamic'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 256}, "group_size"),
        ({"quant_method": "gptq", "bits": 5, "group_size": 128}, "bits"),
        ({"quant_method": "gptq", "group_size": 128}, "missing 'bits'"),
    ],
)
def test_config_errors(cfg, match):
    with pytest.raises(QinferError, match=match):
        scheme_from_gptq_config(cfg)


def test_export_errors():
    with pytest.raises(QinferError, match="integer weights"):
        gptq_quantization_config(QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1))
    asym = QuantScheme(bits=4, group_size=32, symmetric=False)
    W = _weight(N=32, K=64)
    W[5, 32:64] = W[5, 32:64].abs()  # a group with no negative value: zero point 0
    with pytest.raises(QinferError, match=r"p: zero point 0 \(row 5, group 1\) has no encoding in GPTQ v1"):
        to_gptq_tensors(rtn_quantize(W, asym), "p")
    with pytest.raises(QinferError, match="multiples of 32"):
        to_gptq_tensors(rtn_quantize(torch.randn(40, 64), QuantScheme(group_size=32)), "p")


def test_import_errors():
    scheme = QuantScheme(method="gptq", bits=4, group_size=32, symmetric=False)
    W = _weight(N=32, K=64)
    t = to_gptq_tensors(_quantize_without_zero_zero(W, scheme), "p")
    # a g_idx whose groups do not each hold G channels
    bad = dict(t, **{"p.g_idx": torch.zeros(64, dtype=torch.int32)})
    with pytest.raises(QinferError, match="does not put 32 input channels in each of 2 groups"):
        from_gptq_tensors("p", bad, scheme)
    # a stored zero of 15 = real zero 16: what v1 writers produce for a zero point of 0
    bad = dict(t, **{"p.qzeros": t["p.qzeros"] | 0xF})
    with pytest.raises(QinferError, match="stored zero of 15 means 16"):
        from_gptq_tensors("p", bad, scheme)
    # config says symmetric but the zeros are not 2^(b-1)
    with pytest.raises(QinferError, match="sym=true"):
        from_gptq_tensors("p", t, QuantScheme(method="gptq", bits=4, group_size=32))
    with pytest.raises(QinferError, match="missing tensor 'p.qzeros'"):
        from_gptq_tensors("p", {"p.qweight": t["p.qweight"]}, scheme)
    with pytest.raises(QinferError, match=r"^p.scales: torch.float32 scales that float16 cannot hold exactly"):
        from_gptq_tensors("p", dict(t, **{"p.scales": t["p.scales"].float() * (1 + 1e-6)}), scheme)
    with pytest.raises(QinferError, match=r"qzeros: expected int32 \[1, 4\]"):
        from_gptq_tensors("p", t, QuantScheme(method="gptq", bits=4, group_size=-1, symmetric=False))
    # the config's bits wrong for the stored words: named as such, not as a shape GPTQ cannot hold
    with pytest.raises(QinferError, match="hold 32 codes of bits=8, but g_idx has 64 input channels"):
        from_gptq_tensors("p", t, QuantScheme(method="gptq", bits=8, group_size=32, symmetric=False))
    for bad, word in [(float("nan"), "NaN"), (float("-inf"), "infinite"), (-1.0, "negative")]:
        scales = t["p.scales"].clone()
        scales[1, 3] = bad
        with pytest.raises(QinferError, match=f"^p.scales holds {word} scales: the checkpoint is corrupt"):
            from_gptq_tensors("p", dict(t, **{"p.scales": scales}), scheme)
    # a shape GPTQ's readers cannot hold: an import has nothing of the user's to export, so it says what to do
    odd = {"p.qweight": torch.zeros(8, 40, dtype=torch.int32), "p.qzeros": torch.zeros(2, 5, dtype=torch.int32),
           "p.scales": torch.ones(2, 40, dtype=torch.float16)}
    with pytest.raises(QinferError, match=r"got \[N=40, K=64\]; qinfer reads no other GPTQ shapes: quantize the "
                                          r"original model with qinfer instead$"):
        from_gptq_tensors("p", odd, scheme)
    # without g_idx, desc_act's groups are unknown (and static ones would be assumed wrongly)
    with pytest.raises(QinferError, match="p: desc_act is true but the checkpoint has no g_idx"):
        from_gptq_tensors("p", {k: v for k, v in t.items() if k != "p.g_idx"}, replace(scheme, act_order=True))
    # g_idx may be absent; bf16 scales that fit float16 exactly are accepted
    ok = {k: v for k, v in t.items() if not k.endswith("g_idx")}
    ok["p.scales"] = torch.full_like(t["p.scales"], 0.125, dtype=torch.bfloat16)
    assert bool((from_gptq_tensors("p", ok, scheme).scale == 0.125).all())
