"""The compressed-tensors converter is checked against the library itself (compressed-tensors 0.20): its
compressors decompress what qinfer exports to exactly qinfer's dequantized weights, through the model-level
lifecycle transformers uses, and qinfer imports what the library compresses."""

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors checks the converter against the library")

from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)

from qinfer.errors import QinferError  # noqa: E402
from qinfer.format import Fp8Weight, QuantizedWeight, QuantScheme  # noqa: E402
from qinfer.interop.compressed_tensors import (  # noqa: E402
    compressed_tensors_config,
    from_compressed_tensors,
    scheme_from_compressed_tensors_config,
    to_compressed_tensors,
)
from qinfer.quantizers.fp8 import fp8_quantize  # noqa: E402
from qinfer.quantizers.rtn import rtn_params, rtn_quantize  # noqa: E402

INT_SCHEMES = [
    QuantScheme(bits=b, group_size=G, symmetric=sym) for b in (2, 3, 4, 8) for G in (32, -1) for sym in (True, False)
]
FP8_SCHEMES = [
    QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1, fp8_granularity=g) for g in ("channel", "tensor")
]


def _id(s):
    if s.format == "fp8":
        return f"fp8-{s.fp8_granularity}"
    return f"b{s.bits}-g{s.group_size}-{'sym' if s.symmetric else 'asym'}"


def _weight(N=40, K=96, seed=0):
    # N = 40 is not a multiple of 32: the zero points' stream along N ends inside a word.
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * torch.logspace(-2, 0, N)[:, None]


def _quantize(W, scheme):
    return fp8_quantize(W, scheme) if scheme.format == "fp8" else rtn_quantize(W, scheme)


def _library_scheme(scheme):
    """The library's parse of qinfer's config: its QuantizationScheme and the compressor the format names."""
    cfg = QuantizationConfig.model_validate(compressed_tensors_config(scheme))
    (lib_scheme,) = cfg.config_groups.values()
    return cfg, lib_scheme, BaseCompressor.get_value_from_registry(cfg.format)


def _local(tensors, prefix):
    return {k[len(prefix) + 1 :]: v for k, v in tensors.items()}


@pytest.mark.parametrize("scheme", INT_SCHEMES + FP8_SCHEMES, ids=_id)
def test_library_decompresses_qinfer_export_exactly(scheme):
    qw = _quantize(_weight(), scheme)
    cfg, lib_scheme, compressor = _library_scheme(scheme)
    exported = to_compressed_tensors(qw, "model.layers.0.mlp.up_proj")
    if scheme.format == "fp8":
        assert cfg.format == "float-quantized" and set(_local(exported, "model.layers.0.mlp.up_proj")) == {
            "weight",
            "weight_scale",
        }
        expected = qw.dequantize(torch.float32)  # the library multiplies in the scale's dtype, float32
    else:
        assert cfg.format == "pack-quantized"
        assert compressor.__name__ == "PackedQuantizationCompressor"
        names = set(compressor.compression_param_names(lib_scheme))
        assert set(_local(exported, "model.layers.0.mlp.up_proj")) == names
        expected = qw.dequantize(torch.float16)  # (q - zp) * scale in float16: one rounding, as qinfer's cast
    out = compressor.decompress(_local(exported, "model.layers.0.mlp.up_proj"), lib_scheme)
    assert out["weight"].dtype == expected.dtype
    assert torch.equal(out["weight"], expected)


@pytest.mark.parametrize("scheme", INT_SCHEMES + FP8_SCHEMES, ids=_id)
def test_library_packs_the_same_bits(scheme):
    # The library compresses qinfer's own dequantized weights with qinfer's scales and zero points:
    # the stored tensors must be identical to qinfer's export, and qinfer imports them back exactly.
    qw = _quantize(_weight(seed=1), scheme)
    _, lib_scheme, compressor = _library_scheme(scheme)
    state = {"weight": qw.dequantize(torch.float32)}
    if scheme.format == "fp8":
        state["weight_scale"] = qw.scale
    else:
        state["weight_scale"] = qw.scale
        if not scheme.symmetric:  # the library's zero point is signed: qinfer's zero - 2^(b-1)
            state["weight_zero_point"] = (qw.zero.to(torch.int16) - (1 << (scheme.bits - 1))).to(torch.int8)
    compressed = compressor.compress(state, lib_scheme)
    ours = _local(to_compressed_tensors(qw, "p"), "p")
    assert set(compressed) == set(ours)
    for key, t in ours.items():
        theirs = compressed[key]
        assert theirs.dtype == t.dtype and theirs.shape == t.shape, key
        if t.dtype == torch.float8_e4m3fn:  # compare the bits (torch.equal has no float8 kernel on CPU)
            t, theirs = t.view(torch.uint8), theirs.view(torch.uint8)
        assert torch.equal(theirs, t), key
    back = from_compressed_tensors("p", {f"p.{k}": v for k, v in compressed.items()}, scheme)
    if scheme.format == "fp8":
        assert torch.equal(back.weight.view(torch.uint8), qw.weight.view(torch.uint8))
        assert torch.equal(back.scale, qw.scale)
    else:
        assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scale, qw.scale)
        assert (back.zero is None and qw.zero is None) or torch.equal(back.zero, qw.zero)


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (3, False)])
def test_import_of_a_library_quantized_weight(bits, symmetric):
    # A weight quantized and compressed by the library from bfloat16 weights with bfloat16 scales, the way
    # llm-compressor writes checkpoints; qinfer's import dequantizes to what the library decompresses.
    W = _weight(N=64, K=128, seed=2).bfloat16()
    G = 32
    scheme = QuantScheme(bits=bits, group_size=G, symmetric=symmetric)
    _, lib_scheme, compressor = _library_scheme(scheme)
    scale16, zero = rtn_params(W.float(), bits, G, symmetric)
    scale = scale16.bfloat16()  # bfloat16 values in this range are exact in float16
    state = {"weight": W, "weight_scale": scale}
    if not symmetric:
        state["weight_zero_point"] = (zero.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
    compressed = {f"m.{k}": v for k, v in compressor.compress(state, lib_scheme).items()}
    lib_w = compressor.decompress(_local(compressed, "m"), lib_scheme)["weight"]  # bfloat16
    qw = from_compressed_tensors("m", compressed, scheme)
    assert isinstance(qw, QuantizedWeight) and qw.scale.dtype == torch.float16
    assert torch.equal(qw.dequantize(torch.bfloat16), lib_w)
    assert (W.float() - qw.dequantize(torch.float32)).abs().max() <= scale.float().max()


LIFECYCLE = [
    QuantScheme(bits=4, group_size=32, symmetric=False),
    QuantScheme(bits=8, group_size=-1),
    QuantScheme(bits=3, group_size=-1, symmetric=False),
    FP8_SCHEMES[0],
    QuantScheme(bits=4, group_size=32, symmetric=False, quantize_lm_head=True),  # + an int8 lm_head (group_1)
]


@pytest.mark.parametrize("scheme", LIFECYCLE, ids=_id)
def test_model_compressor_lifecycle(scheme):
    # What transformers does on load: apply the config to the float model, compress it (creating the
    # compressed parameters), load the checkpoint's tensors strictly, then decompress.
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(64, 96, bias=False)
            self.down_proj = torch.nn.Linear(96, 64, bias=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block()])
            self.lm_head = torch.nn.Linear(64, 10, bias=False)

    model = Model().half()
    config = QuantizationConfig.model_validate(compressed_tensors_config(scheme))
    head = scheme.quantize_lm_head
    assert config.ignore == ([] if head else ["lm_head"])
    assert config.quantization_status == QuantizationStatus.COMPRESSED
    apply_quantization_config(model, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)

    g = torch.Generator().manual_seed(3)
    linears = [(n, m) for n, m in model.named_modules() if n.endswith("_proj") or (head and n == "lm_head")]
    weights = {n: _quantize(torch.randn(m.out_features, m.in_features, generator=g),
                            scheme.lm_head_scheme() if n == "lm_head" else scheme) for n, m in linears}
    if head:  # the library's own matching gave the lm_head its 8 bits (an exact name outranks the class)
        assert model.lm_head.quantization_scheme.weights.num_bits == 8 and weights["lm_head"].bits == 8
        assert model.layers[0].up_proj.quantization_scheme.weights.num_bits == 4
    state = {} if head else {"lm_head.weight": model.lm_head.weight.data}
    for name, w in weights.items():
        state.update(to_compressed_tensors(w, name))
    model.load_state_dict(state, strict=True)
    compressor.decompress_model(model)
    for name, w in weights.items():
        got = model.get_submodule(name).weight.data
        if isinstance(w, Fp8Weight):
            # the library allocates weight_scale in the model's dtype, so loading rounds the float32 scale
            w = Fp8Weight(w.weight, w.scale.half().float())
        assert got.dtype == torch.float16 and torch.equal(got, w.dequantize(torch.float16)), name


def test_config_and_scheme_round_trip():
    for scheme in INT_SCHEMES + FP8_SCHEMES:
        assert scheme_from_compressed_tensors_config(compressed_tensors_config(scheme)) == scheme
    gptq = QuantScheme(method="gptq", bits=4, group_size=128, act_order=True)
    back = scheme_from_compressed_tensors_config(compressed_tensors_config(gptq), method="gptq")
    assert back.method == "gptq" and back.bits == 4 and back.group_size == 128
    lm = QuantScheme(bits=8, group_size=-1, quantize_lm_head=True, lm_head_bits=8)
    assert compressed_tensors_config(lm)["ignore"] == []
    assert scheme_from_compressed_tensors_config(compressed_tensors_config(lm)) == lm
    cfg = compressed_tensors_config(QuantScheme(bits=4, group_size=128))
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    assert cfg["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group", "dynamic": False,
    }
    head8 = QuantScheme(quantize_lm_head=True)  # 4-bit linears, int8 lm_head: a second group, by name
    cfg = compressed_tensors_config(head8)
    assert cfg["ignore"] == [] and cfg["config_groups"]["group_1"]["targets"] == ["lm_head"]
    assert cfg["config_groups"]["group_1"]["weights"] == {**cfg["config_groups"]["group_0"]["weights"], "num_bits": 8}
    assert scheme_from_compressed_tensors_config(cfg) == head8
    for bad in ({"num_bits": 8, "group_size": 32}, {"num_bits": 8, "symmetric": False}):
        cfg = compressed_tensors_config(head8)
        cfg["config_groups"]["group_1"]["weights"].update(bad)
        with pytest.raises(QinferError, match="lm_head's config group differs"):
            scheme_from_compressed_tensors_config(cfg)
    cfg = compressed_tensors_config(head8)
    cfg["config_groups"]["group_1"]["targets"] = ["re:.*down_proj$"]
    with pytest.raises(QinferError, match="2 config groups; qinfer converts checkpoints with one, or one and a second"):
        scheme_from_compressed_tensors_config(cfg)


def _preset_config(name, fmt):
    cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(name, ["Linear"])}, format=fmt)
    cfg.ignore = ["lm_head"]
    return cfg.model_dump()


def test_library_presets():
    assert scheme_from_compressed_tensors_config(_preset_config("W4A16", "pack-quantized")) == QuantScheme(
        bits=4, group_size=128, symmetric=True
    )
    assert scheme_from_compressed_tensors_config(_preset_config("W4A16_ASYM", "pack-quantized")) == QuantScheme(
        bits=4, group_size=128, symmetric=False
    )
    assert scheme_from_compressed_tensors_config(_preset_config("W8A16", "pack-quantized")).bits == 8
    # FP8_DYNAMIC: per-channel FP8 weights plus dynamic per-token activations, which qinfer leaves in 16 bits
    assert scheme_from_compressed_tensors_config(_preset_config("FP8_DYNAMIC", "float-quantized")) == FP8_SCHEMES[0]
    with pytest.raises(QinferError, match="static activation scales"):
        scheme_from_compressed_tensors_config(_preset_config("FP8", "float-quantized"))
    with pytest.raises(QinferError, match="W8A8"):
        scheme_from_compressed_tensors_config(_preset_config("W8A8", "pack-quantized"))
    with pytest.raises(QinferError, match=r"4-bit integer weights with 8-bit activation quantization \(W4A8\)"):
        scheme_from_compressed_tensors_config(_preset_config("W4A8", "pack-quantized"))
    for preset in ("NVFP4A16", "MXFP4A16"):  # 4-bit floats: named as such, not as FP8 in the wrong format
        with pytest.raises(QinferError, match=r"4-bit float weights \(format 'nvfp4-pack-quantized'\) are not"):
            scheme_from_compressed_tensors_config(_preset_config(preset, "nvfp4-pack-quantized"))
    with pytest.raises(QinferError, match="format 'int-quantized'"):
        scheme_from_compressed_tensors_config(_preset_config("W4A16", "int-quantized"))
    g16 = _preset_config("W4A16", "pack-quantized")
    g16["config_groups"]["group_0"]["weights"]["group_size"] = 16  # not a qinfer group size
    with pytest.raises(QinferError, match=r"compressed-tensors\): group_size \(--group-size\) must be one of"):
        scheme_from_compressed_tensors_config(g16)


def test_config_errors():
    cfg = compressed_tensors_config(QuantScheme())
    with pytest.raises(QinferError, match="not 'compressed-tensors'"):
        scheme_from_compressed_tensors_config(cfg | {"quant_method": "gptq"})
    two = cfg | {"config_groups": {"a": cfg["config_groups"]["group_0"], "b": cfg["config_groups"]["group_0"]}}
    with pytest.raises(QinferError, match="2 config groups"):
        scheme_from_compressed_tensors_config(two)
    # hand-edited shapes: one line each, not an AttributeError
    group = cfg["config_groups"]["group_0"]
    for bad, message in [({"config_groups": [group]}, "config_groups is of type list, not an object of named groups"),
                         ({"config_groups": {"group_0": "W4A16"}}, "the config group is of type str, not an object"),
                         ({"config_groups": {"group_0": group | {"input_activations": 8}}},
                          "input_activations is of type int, not an object")]:
        with pytest.raises(QinferError, match=message):
            scheme_from_compressed_tensors_config(cfg | bad)


def test_act_order_group_checkpoint_imports_and_exports_to_gptq_only():
    # actorder "group" (written before compressed-tensors 0.20 removed it): codes in channel order, channel k
    # in group g_idx[k]; w[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]] (published dequantize)
    asym = QuantScheme(bits=4, group_size=32, symmetric=False)
    qw = rtn_quantize(_weight(), asym)
    t = to_compressed_tensors(qw, "p")
    g_idx = torch.arange(96, dtype=torch.int32).flip(0) // 32  # channel k in group (95 - k) // 32
    back = from_compressed_tensors("p", {**t, "p.weight_g_idx": g_idx}, asym)
    codes, zero, scale = qw.codes().float(), qw.zero.float(), qw.scale.float()
    g = g_idx.long()
    assert torch.equal(back.dequantize(torch.float32), (codes - zero[:, g]) * scale[:, g])
    with pytest.raises(QinferError, match="export with --format gptq"):
        to_compressed_tensors(back, "p")


def test_import_errors():
    asym = QuantScheme(bits=4, group_size=32, symmetric=False)
    t = to_compressed_tensors(rtn_quantize(_weight(), asym), "p")
    with pytest.raises(QinferError, match="present but the config says symmetric"):
        from_compressed_tensors("p", t, QuantScheme(bits=4, group_size=32))
    with pytest.raises(QinferError, match="missing tensor 'p.weight_zero_point'"):
        from_compressed_tensors("p", {k: v for k, v in t.items() if "zero" not in k}, asym)
    with pytest.raises(QinferError, match=r"\[40, 9\] for weight_shape \[40, 96\] at 3 bits, got \[40, 12\]"):
        from_compressed_tensors("p", t, QuantScheme(bits=3, group_size=32, symmetric=False))
    with pytest.raises(QinferError, match="float16 cannot hold exactly"):
        from_compressed_tensors("p", dict(t, **{"p.weight_scale": t["p.weight_scale"].float() / 3}), asym)
    with pytest.raises(QinferError, match="does not put 32 input channels in each of 3 groups"):
        from_compressed_tensors("p", dict(t, **{"p.weight_g_idx": torch.zeros(96, dtype=torch.int32)}), asym)
    scales = t["p.weight_scale"].float()
    scales[0, 0] = float("nan")  # a bf16 or fp32 NaN is named as such, not as a value float16 cannot hold
    with pytest.raises(QinferError, match="^p.weight_scale holds NaN scales: the checkpoint is corrupt"):
        from_compressed_tensors("p", dict(t, **{"p.weight_scale": scales}), asym)
    fp8 = to_compressed_tensors(fp8_quantize(_weight(), FP8_SCHEMES[0]), "q")
    with pytest.raises(QinferError, match="fp8_granularity"):
        from_compressed_tensors("q", fp8, FP8_SCHEMES[1])
    bad = dict(fp8, **{"q.weight_scale": fp8["q.weight_scale"].clone().fill_(float("inf"))})
    with pytest.raises(QinferError, match=r"^q.scale holds infinite scales.*\(from q.weight_scale\)"):
        from_compressed_tensors("q", bad, FP8_SCHEMES[0])
    # a 0-d per-tensor scale in bfloat16 is read as float32 [1]
    fp8_t = to_compressed_tensors(fp8_quantize(_weight(), FP8_SCHEMES[1]), "q")
    fp8_t["q.weight_scale"] = torch.tensor(0.5, dtype=torch.bfloat16)
    back = from_compressed_tensors("q", fp8_t, FP8_SCHEMES[1])
    assert isinstance(back, Fp8Weight) and back.scale.dtype == torch.float32 and back.scale.shape == (1,)


def test_the_exported_kv_cache_scheme_is_the_librarys_static_fp8_cache():
    # what qinfer's compressed-tensors export declares for the KV cache: the library parses it as static per-tensor
    # FP8 and registers one k_scale / v_scale of shape [1] per attention module for it, the shape the export writes
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    from qinfer.interop.compressed_tensors import FP8_KV_CACHE_SCHEME

    args = QuantizationArgs.model_validate(FP8_KV_CACHE_SCHEME)
    assert (args.num_bits, args.type, args.strategy) == (8, "float", "tensor")
    assert (args.dynamic, args.symmetric) == (False, True)
    attention = torch.nn.Module()
    for name in ("k", "v"):
        initialize_qparams(attention, name, args, observed_shape=(2, None, 16), observed_dtype=torch.float32,
                           force_zero_point=False)  # as the library applies a kv_cache_scheme
    assert {n: tuple(p.shape) for n, p in attention.named_parameters()} == {"k_scale": (1,), "v_scale": (1,)}
