"""GPTQ checkpoint layout, format v1 (``"checkpoint_format": "gptq"``), to and from qinfer's integer weights.

Published by AutoGPTQ in ``QuantLinear.pack`` and the torch dequantization of ``QuantLinear.forward``
(``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py``). GPTQModel writes the same v1 layout (its
``convert_gptq_v2_to_v1_format`` applies the zero-minus-one offset) and vLLM's ``gptq`` kernels read it
(``csrc/quantization/gptq/q_gemm.cu`` adds its ``zero_offset`` of 1 to every stored zero for v1).

Tensors of a linear with prefix ``P``, weight ``W [N, K]`` (out, in features), ``b`` bits, group size ``G``
(``G = K`` per channel, written ``group_size: -1``) and ``n_g = K / G`` groups:

=============  =======  =================  =======================================================
tensor         dtype    shape              content
=============  =======  =================  =======================================================
``P.qweight``  int32    [K * b / 32, N]    column ``n``: the codes ``q[n, 0..K)``, one bit stream
``P.qzeros``   int32    [n_g, N * b / 32]  row ``g``: ``zero[n, g] - 1`` for ``n = 0..N``, one bit stream
``P.scales``   float16  [n_g, N]           ``scale[n, g]`` (qinfer's ``P.scale`` transposed)
``P.g_idx``    int32    [K]                group of input channel ``k``: ``k // G`` (static groups)
=============  =======  =================  =======================================================

Bit streams (see :mod:`qinfer.interop.common`): value ``i`` of a stream sits at stream bits
``[i*b, (i+1)*b)``, least significant bit first; stream bit ``j`` is bit ``j % 32`` of int32 word ``j // 32``.
Spelled out as AutoGPTQ's packer writes it, with ``q_i`` the values of one column (``|`` is OR)::

    b = 2, 4, 8:  word[r] = q[r*32/b] | q[r*32/b + 1] << b | ... | q[r*32/b + 32/b - 1] << (32 - b)
    b = 3:        32 values fill 3 words and values 10 and 21 straddle a word boundary:
                  word[3i]   = q[32i] | q[32i+1] << 3 | ... | q[32i+9] << 27 | (q[32i+10] & 0b11) << 30
                  word[3i+1] = q[32i+10] >> 2 | q[32i+11] << 1 | ... | q[32i+20] << 28 | (q[32i+21] & 1) << 31
                  word[3i+2] = q[32i+21] >> 1 | q[32i+22] << 2 | ... | q[32i+31] << 29

Dequantization (what the v1 readers compute)::

    w[n, k] = scales[g_idx[k], n] * (q[n, k] - (qzeros_value[g_idx[k], n] + 1))

so codes and zeros mean exactly what they mean in qinfer: the stored zero is the real zero minus one (the
historical v1 convention). A symmetric scheme has the real zero ``2^(b-1)`` (GPTQ's symmetric grid is
qinfer's), stored as ``2^(b-1) - 1``: every 4-bit qzeros word is ``0x77777777``.

A real zero of 0 has no v1 encoding: it would be stored as -1, which AutoGPTQ's packer ORs into the word as a 32-bit
two's complement (corrupting the neighbouring zeros) and which readers do not agree on: AutoGPTQ's torch path masks
the field plus 1 to ``b`` bits and reads 0, kernels that add 1 unmasked read ``2^b``. :func:`to_gptq_tensors`
refuses such a weight and :func:`from_gptq_tensors` refuses a stored ``2^b - 1``. An asymmetric weight with a group
whose zero point rounds to 0 (its minimum is above ``-scale / 2``) needs another format: compressed-tensors stores
zero points as they are.

Shapes: ``K`` and ``N`` must be multiples of 32 (the buffers AutoGPTQ allocates are ``K // 32 * b`` and
``N // 32 * b`` words). qinfer's static groups make ``g_idx`` trivial, so ``desc_act`` is written false even
for a scheme with ``act_order`` (a true ``desc_act`` tells kernels to reorder by ``g_idx``). An imported
``g_idx`` that is not ``k // G`` (act-order without static groups: G channels per group, in act order) is
kept as the format's column permutation ``perm`` and written back as it was, with ``desc_act`` true; a checkpoint
whose ``desc_act`` is true must hold ``g_idx`` (without it, static groups are assumed only when ``desc_act`` is
false). The layout does not record the algorithm: RTN and AWQ weights export as
``"gptq"`` checkpoints too (AutoAWQ's own GEMM layout is a different, interleaved format).

``quantization_config`` (the ``config.json`` entry): ``quant_method "gptq"``, ``bits``, ``group_size``,
``desc_act``, ``sym``, ``checkpoint_format "gptq"``, ``lm_head`` and ``damp_percent``; where a quantized lm_head
has other bits than the linears (qinfer's default int8 lm_head beside 4-bit linears), GPTQModel's per-module
override ``"dynamic": {"+:^lm_head$": {"bits": 8}}``, which vLLM reads too.
"""

from __future__ import annotations

import torch

from qinfer.errors import QinferError
from qinfer.format import QuantizedWeight, QuantScheme, group_count, pack, unpack
from qinfer.interop.common import (
    exact_fp16,
    get_tensor,
    group_order,
    pack_words,
    static_group_index,
    stream_to_words,
    unpack_words,
    words_to_stream,
)

CHECKPOINT_FORMAT = "gptq"


def gptq_quantization_config(scheme: QuantScheme) -> dict:
    """The ``quantization_config`` entry of ``config.json`` for a GPTQ v1 checkpoint of ``scheme``."""
    if scheme.format != "int":
        raise QinferError(f"GPTQ checkpoints hold integer weights; scheme format is {scheme.format!r}")
    config = {
        "quant_method": "gptq",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "desc_act": False,
        "sym": scheme.symmetric,
        "checkpoint_format": CHECKPOINT_FORMAT,
        "lm_head": scheme.quantize_lm_head,
        "damp_percent": scheme.damp,
    }
    if scheme.quantize_lm_head and scheme.lm_head_bits != scheme.bits:
        config["dynamic"] = {LM_HEAD_PATTERN: {"bits": scheme.lm_head_bits}}
    return config


# GPTQModel's per-module overrides ("dynamic": {pattern: {key: value}}, a "+:" pattern overriding the config's
# keys for the modules it re.match-es, as vLLM's gptq_utils.get_dynamic_override reads them): qinfer writes one,
# the lm_head's bits, and reads back that one alone.
LM_HEAD_PATTERN = "+:^lm_head$"
_LM_HEAD_PATTERNS = ("lm_head", "^lm_head", "lm_head$", "^lm_head$", ".*lm_head", ".*lm_head$")


def _lm_head_bits(config: dict, bits: int) -> int:
    """The lm_head's bits under ``config``'s ``dynamic`` overrides (``bits`` without one); refuses any other
    override, which would give linears other schemes than the config's."""
    dynamic = config.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise QinferError(f"quantization_config: dynamic is of type {type(dynamic).__name__}, not an object")
    fixed = {key: config.get(key, default)
             for key, default in (("group_size", None), ("sym", True), ("desc_act", False))}
    for pattern, override in dynamic.items():
        if (not isinstance(pattern, str) or pattern.startswith("-:") or pattern.removeprefix("+:") not in
                _LM_HEAD_PATTERNS or not isinstance(override, dict) or set(override) - {"bits", *fixed}
                or any(override.get(key, value) != value for key, value in fixed.items())):
            raise QinferError(
                f"quantization_config: the per-module override ('dynamic') {pattern!r}: {override!r} is not "
                "supported; qinfer reads GPTQ checkpoints with one bits and group_size for every linear but the "
                "lm_head's bits"
            )
        bits = override.get("bits", bits)
    return bits


def scheme_from_gptq_config(config: dict) -> QuantScheme:
    """The :class:`QuantScheme` of a GPTQ v1 ``quantization_config`` (method ``"gptq"``)."""
    if not isinstance(config, dict) or config.get("quant_method") != "gptq":
        got = config.get("quant_method") if isinstance(config, dict) else type(config).__name__
        raise QinferError(f"quantization_config: quant_method is {got!r}, not 'gptq'")
    # "format" (GPTQModel, transformers 5) and the older "checkpoint_format": each one given must say v1
    for key in ("format", "checkpoint_format"):
        fmt = config.get(key, CHECKPOINT_FORMAT)
        if fmt != CHECKPOINT_FORMAT:
            raise QinferError(
                f"quantization_config: {key} {fmt!r} is not supported; qinfer reads GPTQ format v1 "
                "('gptq'): convert the checkpoint to v1 with GPTQModel first"
            )
    for key in ("bits", "group_size"):
        if key not in config:
            raise QinferError(f"quantization_config: missing {key!r}")
    bits = config["bits"]
    lm_head = config.get("lm_head", False)
    head_bits = _lm_head_bits(config, bits)
    damp = config.get("damp_percent", 0.01)
    try:
        return QuantScheme(
            method="gptq",
            bits=bits,
            group_size=config["group_size"],
            symmetric=config.get("sym", True),
            act_order=config.get("desc_act", False),
            quantize_lm_head=lm_head,
            lm_head_bits=head_bits if lm_head is True else 8,
            damp=damp if isinstance(damp, (int, float)) and 0 < damp <= 1 else 0.01,
        )
    except QinferError as e:
        raise QinferError(f"quantization_config (gptq): {e}") from None


def _check_shape(N: int, K: int, name: str, fix: str = "export this model with --format compressed-tensors") -> None:
    if K % 32 or N % 32:
        raise QinferError(
            f"{name}: GPTQ needs in_features and out_features that are multiples of 32 (its readers size their "
            f"buffers in 32-column blocks), got [N={N}, K={K}]; {fix}"
        )


def to_gptq_tensors(weight: QuantizedWeight, prefix: str) -> dict[str, torch.Tensor]:
    """``P.qweight``, ``P.qzeros``, ``P.scales`` and ``P.g_idx`` of ``weight`` in the GPTQ v1 layout."""
    N, K = weight.shape
    b = weight.bits
    _check_shape(N, K, prefix)
    zero = weight.zero if weight.zero is not None else torch.full_like(weight.scale, 1 << (b - 1), dtype=torch.uint8)
    if bool((zero == 0).any()):
        n, g = (int(i) for i in (zero == 0).nonzero()[0])
        raise QinferError(
            f"{prefix}: zero point 0 (row {n}, group {g}) has no encoding in GPTQ v1, which stores zero - 1; "
            "export asymmetric weights to compressed-tensors, or quantize symmetrically"
        )
    stream = weight.qweight if weight.perm is None else pack(weight.unpermute(weight.codes()), b)  # channel order
    return {
        f"{prefix}.qweight": stream_to_words(stream).T.contiguous(),
        f"{prefix}.qzeros": pack_words((zero - 1).T, b),
        f"{prefix}.scales": weight.scale.T.contiguous(),
        f"{prefix}.g_idx": weight.unpermute(static_group_index(K, weight.group_size)),  # channel perm[j]: j // G
    }


def from_gptq_tensors(prefix: str, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantizedWeight:
    """Read ``prefix``'s GPTQ v1 tensors back into a :class:`QuantizedWeight` (``scheme`` from the config).

    ``P.g_idx`` may be absent (static groups are assumed); one that is not ``k // G`` (act-order without
    static groups) becomes the format's ``perm``. ``P.bias`` is not part of the weight.
    """
    if scheme.format != "int":
        raise QinferError(f"{prefix}: scheme format is {scheme.format!r}, not 'int'")
    b, G = scheme.bits, scheme.group_size
    qweight = get_tensor(tensors, f"{prefix}.qweight", torch.int32, 2)
    qzeros = get_tensor(tensors, f"{prefix}.qzeros", torch.int32, 2)
    scales = get_tensor(tensors, f"{prefix}.scales", None, 2)
    N, K = qweight.shape[1], qweight.shape[0] * 32 // b
    if qweight.shape[0] * 32 % b:
        raise QinferError(f"{prefix}.qweight: {qweight.shape[0]} words per column do not hold whole {b}-bit codes")
    g_idx = tensors.get(f"{prefix}.g_idx")
    if g_idx is not None and g_idx.dim() == 1 and g_idx.numel() != K:  # one entry per input channel
        raise QinferError(
            f"{prefix}: qweight's {qweight.shape[0]} words per column hold {K} codes of bits={b}, but g_idx has "
            f"{g_idx.numel()} input channels: quantization_config's bits does not match the stored weights"
        )
    _check_shape(N, K, prefix, "qinfer reads no other GPTQ shapes: quantize the original model with qinfer instead")
    n_g = group_count(K, G)
    if G != -1 and K % G:
        raise QinferError(f"{prefix}: group_size {G} does not divide in_features K={K}")
    if tuple(qzeros.shape) != (n_g, N * b // 32):
        raise QinferError(f"{prefix}.qzeros: expected int32 [{n_g}, {N * b // 32}], got {list(qzeros.shape)}")
    if tuple(scales.shape) != (n_g, N):
        raise QinferError(f"{prefix}.scales: expected [{n_g}, {N}], got {list(scales.shape)}")
    g_idx_key = f"{prefix}.g_idx"
    if g_idx_key not in tensors and scheme.act_order and G != -1:
        raise QinferError(f"{prefix}: desc_act is true but the checkpoint has no g_idx, which alone says which group "
                          "each input channel is in: the checkpoint is incomplete")
    perm = group_order(tensors[g_idx_key], K, G, g_idx_key) if g_idx_key in tensors else None

    zero = unpack_words(qzeros, b, N).T.to(torch.int16) + 1  # [N, n_g], in [1, 2^b]
    if bool((zero == 1 << b).any()):
        raise QinferError(
            f"{prefix}.qzeros: a stored zero of {(1 << b) - 1} means {1 << b} under v1's zero-minus-one convention "
            "(a real zero of 0 that v1 cannot hold); this checkpoint cannot be converted exactly"
        )
    if scheme.symmetric:
        if bool((zero != 1 << (b - 1)).any()):
            raise QinferError(
                f"{prefix}.qzeros: zero points other than {1 << (b - 1)} but quantization_config says sym=true"
            )
        zero = None
    scale = exact_fp16(scales, f"{prefix}.scales").T.contiguous()
    stream = words_to_stream(qweight.T.contiguous(), K * b // 8)  # codes in input-channel order
    if perm is not None:
        stream = pack(unpack(stream, b, K)[:, perm.long()], b)  # stored in group order
    try:
        return QuantizedWeight(
            qweight=stream,
            scale=scale,
            zero=None if zero is None else zero.to(torch.uint8),
            bits=b,
            group_size=G,
            shape=(N, K),
            perm=perm,
        )
    except QinferError as e:
        raise QinferError(f"{prefix}: {e}") from None
