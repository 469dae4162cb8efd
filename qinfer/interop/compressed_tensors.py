"""compressed-tensors checkpoints (vLLM's ``compressed-tensors`` library, as written by llm-compressor) to
and from qinfer's weights: ``pack-quantized`` integers (W4A16, W8A16, ...) and ``float-quantized`` FP8.

Published in the library itself (checked against version 0.20.0): ``compressors/pack_quantized/helpers.py``
(``pack_to_int32`` / ``unpack_from_int32``), ``compressors/pack_quantized/base.py`` (tensor names, which dim
is packed), ``compressors/naive_quantized/base.py`` (FP8), ``quantization/lifecycle/forward.py``
(``dequantize``) and ``quantization/quant_args.py`` / ``quant_config.py`` (the config). The tests run the
library's own compressors against these converters in both directions.

Integer weights, ``format: "pack-quantized"`` (``W [N, K]``, ``b`` bits, ``n_g`` groups as in qinfer)
-------------------------------------------------------------------------------------------------------
=========================  =======  =======================  ==============================================
tensor                     dtype    shape                    content
=========================  =======  =======================  ==============================================
``P.weight_packed``        int32    [N, ceil(K * b / 32)]    row ``n``: ``q_s[n, k] + 2^(b-1)`` (= qinfer's
                                                             code ``q[n, k]``) for ``k = 0..K``, one bit
                                                             stream along K, zero bits after the last code
``P.weight_scale``         float16  [N, n_g]                 ``scale[n, g]``; ``[N, 1]`` per channel
``P.weight_zero_point``    int32    [ceil(N * b / 32), n_g]  column ``g``: ``zp[n, g] + 2^(b-1)`` (= qinfer's
                                                             ``zero[n, g]``) for ``n = 0..N``, one bit stream
                                                             along N (packed along dim 0); asymmetric only
``P.weight_shape``         int64    [2]                      ``[N, K]``
``P.weight_g_idx``         int32    [K]                      group of input channel ``k``; read only, from
                                                             ``actorder: "group"`` checkpoints
=========================  =======  =======================  ==============================================

Bit streams as in :mod:`qinfer.interop.common`: value ``i`` at stream bits ``[i*b, (i+1)*b)``, least
significant bit first, stream bit ``j`` = bit ``j % 32`` of word ``j // 32``; values cross word
boundaries for ``b`` that does not divide 32.

compressed-tensors integers are *signed*: the quantized value ``q_s`` and the zero point ``zp`` lie in
``[-2^(b-1), 2^(b-1) - 1]`` and ``w = (q_s - zp) * scale`` (symmetric: no zero point, ``zp = 0``). Packing
adds ``2^(b-1)`` to every value, zero points included, so the stored bits of ``q_s`` are
``q_s + 2^(b-1)``, which is qinfer's unsigned code ``q``, and the stored bits of ``zp`` are qinfer's
``zero``; a symmetric scheme's implicit zero ``2^(b-1)`` is ``zp = 0``. Dequantization agrees bit for bit.

Config: one ``config_groups`` entry targeting ``Linear`` with ``weights: {num_bits: b, type: "int",
symmetric, strategy: "group" (group_size G) | "channel" (group_size null), dynamic: false}``, no activation
quantization (and a second, targeting ``lm_head`` by name, which outranks the class in the library's matching,
where the lm_head has other bits: qinfer's default int8 lm_head beside 4-bit linears), ``ignore``: ``"lm_head"``
unless it is quantized, and the name of each decoder linear a checkpoint
imported from elsewhere left unquantized. On import the tensors say which linears are quantized (``ignore`` is
not parsed: its entries may be patterns); the others run unquantized. A ``weight_g_idx`` that is
not ``k // G`` (act-order groups, G channels each, from writers before the library removed ``actorder:
"group"`` in 0.20) is kept as the format's column permutation ``perm`` on import; such a weight exports to
the GPTQ layout only.

FP8 weights, ``format: "float-quantized"``
------------------------------------------
==================  =============  ==============  ================================================
``P.weight``        float8_e4m3fn  [N, K]          qinfer's ``P.weight``
``P.weight_scale``  float32        [N, 1] or [1]   strategy ``"channel"`` or ``"tensor"``
==================  =============  ==============  ================================================

``w = weight * weight_scale``; config ``weights: {num_bits: 8, type: "float", symmetric: true, strategy,
dynamic: false}``, weight-only (qinfer computes activations in 16 bits). An imported FP8 checkpoint may
declare *dynamic* activation quantization (``FP8_DYNAMIC``): its weights are the same, and qinfer simply
keeps activations unquantized. Static activation scales, mixed schemes and other formats are refused.

The config does not record the algorithm (RTN, GPTQ, AWQ all write the same tensors), so an imported
integer scheme gets ``method`` from the caller, ``"rtn"`` by default.
"""

from __future__ import annotations

import torch

from qinfer.errors import QinferError
from qinfer.format import FP8_GRANULARITIES, Fp8Weight, QuantizedWeight, QuantScheme, group_count, pack, unpack
from qinfer.interop.common import (
    exact_fp16,
    get_tensor,
    group_order,
    pack_words,
    stream_to_words,
    unpack_words,
    word_count,
    words_to_stream,
)

QUANT_METHOD = "compressed-tensors"
PACKED = "pack-quantized"
FLOAT = "float-quantized"
NAIVE = "naive-quantized"  # what llm-compressor infers for weight-only FP8; same tensors as float-quantized
LM_HEAD = "lm_head"


def compressed_tensors_config(scheme: QuantScheme) -> dict:
    """The ``quantization_config`` entry of ``config.json`` for ``scheme``'s weights."""
    if scheme.format == "fp8":
        fmt = FLOAT
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
        weights["strategy"] = scheme.fp8_granularity
    else:
        fmt = PACKED
        weights = {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric}
        per_channel = scheme.group_size == -1
        weights["group_size"] = None if per_channel else scheme.group_size
        weights["strategy"] = "channel" if per_channel else "group"
    weights["dynamic"] = False
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}
    groups = {"group_0": {**group, "format": fmt}}
    if scheme.quantize_lm_head and scheme.lm_head_bits != scheme.bits:  # (an exact name outranks the class)
        groups["group_1"] = {**group, "targets": [LM_HEAD], "weights": {**weights, "num_bits": scheme.lm_head_bits},
                             "format": fmt}
    return {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [] if scheme.quantize_lm_head else ["lm_head"],
        "kv_cache_scheme": None,
    }


# The static FP8 KV cache an export declares (llm-compressor's, which vLLM's --kv-cache-dtype fp8 reads): one
# scale per layer for the keys and one for the values, amax / 448, each an fp32 tensor of shape [1].
FP8_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def kv_cache_dtype(config: dict) -> str:
    """The KV-cache dtype a compressed-tensors ``kv_cache_scheme`` stores static scales for: "fp8" (8-bit float,
    llm-compressor's FP8 KV cache), "int8", or "none" (no scheme, or a dynamic one: no scales stored)."""
    kv = config.get("kv_cache_scheme")
    if kv is None or (isinstance(kv, dict) and kv.get("dynamic")):
        return "none"
    if not isinstance(kv, dict) or kv.get("num_bits") != 8 or kv.get("type") not in ("float", "int"):
        raise _config_error(f"kv_cache_scheme {kv!r} is not supported; qinfer reads 8-bit float or int KV-cache "
                            "scales")
    if kv.get("symmetric") is False:
        raise _config_error("kv_cache_scheme is asymmetric; qinfer's KV cache has scales only (no zero points)")
    return "fp8" if kv["type"] == "float" else "int8"


def _config_error(message: str) -> QinferError:
    return QinferError(f"quantization_config (compressed-tensors): {message}")


def scheme_from_compressed_tensors_config(config: dict, *, method: str = "rtn") -> QuantScheme:
    """The :class:`QuantScheme` of a compressed-tensors ``quantization_config`` (one weight-only group).

    ``method`` names the algorithm for integer schemes; the checkpoint does not say.
    """
    if not isinstance(config, dict) or config.get("quant_method") != QUANT_METHOD:
        got = config.get("quant_method") if isinstance(config, dict) else type(config).__name__
        raise QinferError(f"quantization_config: quant_method is {got!r}, not {QUANT_METHOD!r}")
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise _config_error(f"config_groups is of type {type(groups).__name__}, not an object of named groups")
    for g in groups.values():
        if not isinstance(g, dict):
            raise _config_error(f"the config group is of type {type(g).__name__}, not an object")
    heads = [g for g in groups.values() if g.get("targets") in ([LM_HEAD], [f"re:.*{LM_HEAD}$"])]
    if len(groups) != 1 + (len(heads) == 1):
        raise _config_error(
            f"{len(groups)} config groups; qinfer converts checkpoints with one, or one and a second for the lm_head "
            "alone (no other mixed precision)"
        )
    (group,) = [g for g in groups.values() if g not in heads]
    head_bits = None
    if heads:  # the same weights but for the bits
        head_weights = heads[0].get("weights")
        if not isinstance(head_weights, dict) or {**head_weights, "num_bits": None} != {
                **(group.get("weights") or {}), "num_bits": None} or heads[0].get("input_activations"):
            raise _config_error("the lm_head's config group differs from the other linears' in more than num_bits")
        head_bits = head_weights.get("num_bits")
    weights = group.get("weights")
    fmt = group.get("format") or config.get("format")
    if not isinstance(weights, dict):
        raise _config_error("the config group quantizes no weights")
    if group.get("output_activations"):
        raise _config_error("output activation quantization is not supported")
    acts = group.get("input_activations")
    if acts is not None and not isinstance(acts, dict):
        raise _config_error(f"input_activations is of type {type(acts).__name__}, not an object")
    kind, strategy, bits = weights.get("type"), weights.get("strategy"), weights.get("num_bits")
    quantize_lm_head = "lm_head" not in (config.get("ignore") or [])
    if weights.get("dynamic", False) is not False:
        raise _config_error("dynamic weight quantization is not a stored checkpoint")
    if kind == "int":
        if fmt != PACKED:
            raise _config_error(f"integer weights in format {fmt!r}; qinfer converts {PACKED!r}")
        if acts:
            raise _config_error(f"{bits}-bit integer weights with {acts.get('num_bits')}-bit activation quantization "
                                f"(W{bits}A{acts.get('num_bits')}) are not supported; qinfer converts weight-only "
                                "integer checkpoints")
        if strategy not in ("group", "channel"):
            raise _config_error(f"integer strategy {strategy!r}; qinfer converts 'group' and 'channel'")
        fields = dict(
            method=method,
            bits=bits,
            group_size=weights.get("group_size") if strategy == "group" else -1,
            symmetric=weights.get("symmetric", True),
            lm_head_bits=(head_bits or bits) if quantize_lm_head else 8,
        )
    elif kind == "float":
        if bits != 8:
            raise _config_error(f"{bits}-bit float weights (format {fmt!r}) are not supported; qinfer converts FP8 "
                                f"(E4M3) in format {FLOAT!r}")
        if fmt not in (FLOAT, NAIVE):
            raise _config_error(f"FP8 weights in format {fmt!r}; qinfer converts {FLOAT!r}")
        if acts and acts.get("dynamic") is not True:
            raise _config_error("static activation scales are not supported (dynamic FP8 activations are)")
        if bits != 8 or strategy not in FP8_GRANULARITIES:
            raise _config_error(
                f"float weights of {bits} bits with strategy {strategy!r}; qinfer converts FP8 (E4M3) per "
                "channel or per tensor"
            )
        fields = dict(
            method="fp8", format="fp8", bits=8, group_size=-1, fp8_granularity=strategy,
            symmetric=weights.get("symmetric", True),
        )
    else:
        raise _config_error(f"weight type {kind!r}; expected 'int' or 'float'")
    try:
        return QuantScheme(**fields, quantize_lm_head=quantize_lm_head)
    except QinferError as e:
        raise _config_error(str(e)) from None


def to_compressed_tensors(weight: QuantizedWeight | Fp8Weight, prefix: str) -> dict[str, torch.Tensor]:
    """``prefix``'s compressed-tensors entries for ``weight`` (see the module docstring)."""
    if isinstance(weight, Fp8Weight):
        return {f"{prefix}.weight": weight.weight, f"{prefix}.weight_scale": weight.scale}
    N, K = weight.shape
    if weight.perm is not None:
        raise QinferError(
            f"{prefix}: act-order groups (an imported g_idx) have no compressed-tensors encoding since the library "
            "removed actorder 'group' (0.20); export with --format gptq"
        )
    out = {
        f"{prefix}.weight_packed": stream_to_words(weight.qweight),
        f"{prefix}.weight_scale": weight.scale,
        f"{prefix}.weight_shape": torch.tensor([N, K], dtype=torch.int64),
    }
    if weight.zero is not None:
        # zero points [N, n_g] packed along N (dim 0): one bit stream per group column
        out[f"{prefix}.weight_zero_point"] = pack_words(weight.zero.T, weight.bits).T.contiguous()
    return out


def from_compressed_tensors(
    prefix: str, tensors: dict[str, torch.Tensor], scheme: QuantScheme
) -> QuantizedWeight | Fp8Weight:
    """Read ``prefix``'s compressed-tensors entries (``scheme`` from the config) into a qinfer weight."""
    if scheme.format == "fp8":
        weight = get_tensor(tensors, f"{prefix}.weight", torch.float8_e4m3fn, 2)
        scale_key = f"{prefix}.weight_scale"
        if scale_key not in tensors:
            raise QinferError(f"missing tensor {scale_key!r} in the checkpoint")
        scale = tensors[scale_key]
        if not scale.dtype.is_floating_point:
            raise QinferError(f"{prefix}.weight_scale: expected floating-point scales, got {scale.dtype}")
        if scheme.fp8_granularity == "tensor" and scale.numel() == 1:
            scale = scale.reshape(1)  # some writers store a 0-d tensor scale
        # float16 / bfloat16 / float32 scales widen to float32 exactly
        try:
            entries = {f"{prefix}.weight": weight, f"{prefix}.scale": scale.float()}
            return Fp8Weight.from_tensors(prefix, entries, scheme)
        except QinferError as e:
            raise QinferError(f"{e} (from {prefix}.weight_scale)") from None

    b, G = scheme.bits, scheme.group_size
    packed = get_tensor(tensors, f"{prefix}.weight_packed", torch.int32, 2)
    shape = get_tensor(tensors, f"{prefix}.weight_shape", None, 1)
    if shape.numel() != 2 or shape.dtype.is_floating_point:
        raise QinferError(f"{prefix}.weight_shape: expected [N, K], got {shape.tolist()}")
    N, K = (int(d) for d in shape.tolist())
    if tuple(packed.shape) != (N, word_count(K, b)):
        raise QinferError(
            f"{prefix}.weight_packed: expected int32 [{N}, {word_count(K, b)}] for weight_shape [{N}, {K}] "
            f"at {b} bits, got {list(packed.shape)}"
        )
    if K * b % 8:
        raise QinferError(f"{prefix}: K={K} codes of {b} bits do not fill whole bytes, which qinfer's layout needs")
    if G != -1 and K % G:
        raise QinferError(f"{prefix}.weight_shape: K={K} is not a multiple of the group size {G} (qinfer's groups "
                          "cover whole rows): the checkpoint is damaged, or not one qinfer converts")
    scale = exact_fp16(get_tensor(tensors, f"{prefix}.weight_scale", None, 2), f"{prefix}.weight_scale")
    g_idx_key = f"{prefix}.weight_g_idx"
    perm = group_order(tensors[g_idx_key], K, G, g_idx_key) if g_idx_key in tensors else None
    zp_key = f"{prefix}.weight_zero_point"
    if scheme.symmetric:
        if zp_key in tensors:
            raise QinferError(f"{zp_key} present but the config says symmetric (checkpoint and config disagree)")
        zero = None
    else:
        n_g = group_count(K, G)
        zp = get_tensor(tensors, zp_key, torch.int32, 2)
        if tuple(zp.shape) != (word_count(N, b), n_g):
            raise QinferError(f"{zp_key}: expected int32 [{word_count(N, b)}, {n_g}], got {list(zp.shape)}")
        zero = unpack_words(zp.T, b, N).T.contiguous()
    stream = words_to_stream(packed, K * b // 8)  # codes in input-channel order
    if perm is not None:
        stream = pack(unpack(stream, b, K)[:, perm.long()], b)  # stored in group order (format: perm)
    try:
        return QuantizedWeight(
            qweight=stream, scale=scale, zero=zero, bits=b, group_size=G, shape=(N, K), perm=perm
        )
    except QinferError as e:
        raise QinferError(f"{prefix}: {e}") from None
