"""The qinfer quantized-weight format, version 1. This docstring is the specification.

A quantized checkpoint is a folder of safetensors files plus ``quant_config.json``: a JSON object with
``"format_version": 1`` and the fields of :class:`QuantScheme` (``method``, ``bits``, ``group_size``, ``symmetric``,
``act_order``, ``format``, ``kv_cache``, ``quantize_lm_head``, ``lm_head_bits``, ``damp``, ``fp8_granularity``,
``mse_clip``), typed exactly (``4``, not ``4.0``); a key left out takes its default there, and any other key is
refused. A quantized linear is stored under the Hugging Face name of its weight minus the ``.weight`` suffix, its
prefix ``P`` (``model.layers.0.mlp.up_proj``). ``W`` is that linear's weight, shape ``[N, K]`` (out features, in
features) as in ``torch.nn.Linear``. Tensors that are not quantized keep their original names and are stored in
bf16, whatever the source held, except float32 norm weights where the norm multiplies by ``1 + w`` (Gemma): those
stay float32 (a source's, or what AWQ's fold or the tuning stages made), as bf16 would keep ``1 + w`` only to a few
percent once it moves far from 1. The lm_head is quantized where its tensors are (``lm_head.qweight`` or, for fp8,
an ``lm_head.weight`` in E4M3 with an ``lm_head.scale``), with the same scheme except ``bits = lm_head_bits``.

Tied embedding. When ``config.json`` sets ``tie_word_embeddings`` and the lm_head is quantized, the folder
holds no ``model.embed_tokens.weight``: token ``t``'s embedding is row ``t`` of the dequantized lm_head, cast
to the compute dtype (as llama.cpp reads ``token_embd`` from a quantized tensor). A folder that does hold a
``model.embed_tokens.weight`` beside its quantized lm_head uses that table instead.

The BOS position. A folder may hold what the *unquantized* model computes at position 0 for ``config.json``'s
``bos_token_id``: for every layer ``i``, ``model.layers.{i}.self_attn.bos_k`` and
``model.layers.{i}.self_attn.bos_v``, each ``[num_kv_heads, head_dim]``, the keys (after the key norm, if any, and
RoPE, as a KV cache holds them) and values; and ``model.bos_hidden``, ``[hidden_size]``, the final norm's output.
All in bf16, as the other unquantized tensors; all of them or none. Wherever position 0 of a sequence holds that
token, attention reads these keys and values there and the model outputs this hidden state there, instead of what
the quantized weights compute (IntactKV keeps the keys and values the same way): position 0 sees only itself, so
these are the same for every such sequence.

KV-cache scales (``kv_cache`` "int8" or "fp8"). For every layer ``i``, ``model.layers.{i}.self_attn.k_scale`` and
``v_scale``, fp32 ``[num_kv_heads, head_dim]`` (or ``[num_kv_heads]``, broadcast), finite, > 0: the calibrated max
``|x|`` (a key after key norm and RoPE, or a value, per channel; as the quantized weights compute them, over every
position of the calibration samples) over 127 or 448, or 1 for a channel whose max is 0, for a static cache storing
``round(x / scale)`` or ``e4m3(x / scale)``, clamped; qinfer's (``kv_cache.py``) uses their ratios, per position.

The paged KV cache (in memory, not in a folder). Per layer, keys and values each in a pool of ``N`` blocks of
``P`` positions (``P`` in {8, 16, 32, 64, 128}; 16 by default), ``[N, Hkv, P, D]`` row-major (``Hkv`` =
``num_kv_heads``, ``D`` = ``head_dim``): a block holds, per KV head, ``P`` contiguous rows of ``D`` elements. A
sequence's block table lists its blocks in position order; its position ``p`` is row ``p % P`` of block
``table[p // P]``. Block ids are the same in every layer. Pages hold the model's dtype (bf16), or codes: int8, or
float8_e4m3fn; then ``[N, Hkv, P]`` fp32 position scales ``t`` (keys and values each) sit beside them, and the
layer's channel scales ``c`` ``[Hkv, D]`` fp32 (the ``k_scale``/``v_scale`` above, else 1) apply to every block::

    t[blk, h, r] = max_d |x_d / c[h, d]| / QMAX          (QMAX 127 for int8, 448 for E4M3; 1e-30 at least)
    int8: code = round(x / (c t)),  E4M3: code = e4m3(x / (c t)),  x ≈ code * c * t

so a position's codes depend on its own values alone, and nothing clips.

Integer weights (``format == "int"``)
-------------------------------------
``b = bits`` in {2, 3, 4, 8}; ``G = group_size``, or ``G = K`` when ``group_size == -1`` (per channel).
Requires ``K % G == 0`` and ``K * b % 8 == 0``.

==============  =======  ==============  ======================================================
tensor          dtype    shape           content
==============  =======  ==============  ======================================================
``P.qweight``   uint8    [N, K * b / 8]  codes ``q[n, k]`` in [0, 2^b), bit-packed as below
``P.scale``     float16  [N, K / G]      ``scale[n, g]``, finite and >= 0
``P.zero``      uint8    [N, K / G]      ``zero[n, g]`` in [0, 2^b); only when not ``symmetric``
==============  =======  ==============  ======================================================

Dequantization, with ``g(k) = k // G``::

    w[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]

evaluated in float32 (codes and zeros are small integers, the fp16 scale widens exactly), then cast to
the compute dtype. A symmetric scheme stores no ``P.zero``; its zero is the constant ``2^(b-1)``, so
``q - zero`` spans [-2^(b-1), 2^(b-1) - 1].
An all-zero group is written with scale 2^-24 (float16's least) and zero 2^(b-1); readers also accept a stored
scale of 0 (the group is then all zeros).

GPTQ with ``act_order`` visits columns by decreasing Hessian diagonal but uses *static groups*: each
group's scale and zero are fixed from the columns ``[g*G, (g+1)*G)`` in their original order, so
``g(k) = k // G`` holds for everything qinfer quantizes itself.

Permuted columns (optional ``P.perm``, int32 ``[K]``, a permutation of ``0..K-1``). A GPTQ or
compressed-tensors checkpoint quantized with act-order *without* static groups gives channel ``k`` the group
``g_idx[k]`` = its rank in the act order // G, so groups are not contiguous. Importing it stores the columns in
group order instead: stored column ``j`` holds input channel ``perm[j]``, and everything above (packing,
``g(j) = j // G``) applies to the stored columns, so::

    w[n, perm[j]] = (q[n, j] - zero[n, j // G]) * scale[n, j // G]

A kernel multiplies the stored columns by ``x[..., perm]``. Without ``P.perm``, ``perm[j] = j``.

Bit packing. Each row of ``qweight`` is a little-endian bit stream: code ``q[n, k]`` occupies stream bits
``[k*b, (k+1)*b)``, its least significant bit first, and stream bit ``i`` is the bit of value
``2^(i % 8)`` in byte ``i // 8`` of the row. Spelled out per width (``j`` indexes bytes, ``|`` is OR)::

    b = 8:  byte[j] = q[j]
    b = 4:  byte[j] = q[2j] | q[2j+1] << 4                      (low nibble = even k)
    b = 2:  byte[j] = q[4j] | q[4j+1] << 2 | q[4j+2] << 4 | q[4j+3] << 6
    b = 3:  eight codes fill three bytes,
            byte[3j]   = q[8j]        | q[8j+1] << 3 | (q[8j+2] & 0b11) << 6
            byte[3j+1] = q[8j+2] >> 2 | q[8j+3] << 1 | q[8j+4] << 4 | (q[8j+5] & 1) << 7
            byte[3j+2] = q[8j+5] >> 1 | q[8j+6] << 2 | q[8j+7] << 5

FP8 weights (``format == "fp8"``)
---------------------------------
==============  =============  ==================  =============================================
tensor          dtype          shape               content
==============  =============  ==================  =============================================
``P.weight``    float8_e4m3fn  [N, K]              ``W / scale`` on the E4M3 grid, saturated
``P.scale``     float32        [N, 1] or [1]       ``fp8_granularity`` "channel" or "tensor"
==============  =============  ==================  =============================================

Method ``fp8`` rounds ``W / scale`` to nearest; method ``gptq`` chooses each value by GPTQ's error feedback
(same grid, same scales). Dequantization: ``w = weight.float() * scale`` (broadcast). E4M3 "fn" has 1 sign,
4 exponent (bias 7) and 3 mantissa bits, no infinities, and a largest finite magnitude of 448; qinfer's
quantizers clamp to ±448 before the cast, so a stored weight is never NaN.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qinfer.errors import QinferError

FORMAT_VERSION = 1
QUANT_CONFIG_FILE = "quant_config.json"

INT_BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128, -1)
METHODS = ("rtn", "gptq", "awq", "fp8")
FORMATS = ("int", "fp8")
KV_CACHE_DTYPES = ("none", "int8", "fp8")
FP8_GRANULARITIES = ("channel", "tensor")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_MAX_SCALE = torch.finfo(torch.float32).max / FP8_MAX  # past it, 448 x scale overflows float32
FP8_SHIFT = 2.0**8  # an E4M3 code's value = the fp16 value of its moved bits (e4m3_as_fp16) * FP8_SHIFT
_SIGN_AND_MAGNITUDE = (0x80 << 8 | 0x7F << 7) - (1 << 16)  # fp16 bits 15 and 13..7, as an int16


# The `qinfer quantize` option that sets each field, named in its error beside the field (quant_config.json's key).
_FLAGS = {"method": "--method", "format": "--format", "kv_cache": "--kv-cache", "group_size": "--group-size",
          "bits": "--bits", "lm_head_bits": "--lm-head-bits", "act_order": "--act-order", "mse_clip": "--mse-clip",
          "quantize_lm_head": "--quantize-lm-head", "symmetric": "--sym/--asym"}


def _choice(field: str, value, allowed: tuple, fix: str = "") -> None:
    # `type(...) is` rather than isinstance/==: True == 1 and "4" != 4 would otherwise slip through JSON.
    if not any(type(value) is type(a) and value == a for a in allowed):
        expected = repr(allowed[0]) if len(allowed) == 1 else f"one of {', '.join(map(repr, allowed))}"
        flag = f" ({_FLAGS[field]})" if field in _FLAGS else ""
        raise QinferError(f"{field}{flag} must be {expected}; got {value!r}{fix}")


@dataclass(frozen=True)
class QuantScheme:
    """How a model's linears are quantized; saved as ``quant_config.json`` beside the weights.

    ``damp`` is GPTQ's relative damping (a fraction of the mean Hessian diagonal). ``fp8_granularity``
    applies to ``format == "fp8"``, where ``bits`` must be 8, ``group_size`` -1 and ``symmetric`` True, and
    ``method`` is ``"fp8"`` (round to nearest) or ``"gptq"`` (GPTQ's error feedback onto the FP8 grid).
    ``kv_cache`` is the dtype the engine stores the KV cache in; it does not affect weights. ``mse_clip``
    records that integer group parameters came from the clip search (``qinfer.quantizers.rtn``) rather than
    the group's min/max; the stored layout is the same either way.
    """

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    format: str = "int"
    kv_cache: str = "none"
    quantize_lm_head: bool = False
    lm_head_bits: int = 8
    damp: float = 0.01
    fp8_granularity: str = "channel"
    mse_clip: bool = False

    def __post_init__(self):
        _choice("method", self.method, METHODS)
        _choice("format", self.format, FORMATS)
        _choice("kv_cache", self.kv_cache, KV_CACHE_DTYPES)
        _choice("fp8_granularity", self.fp8_granularity, FP8_GRANULARITIES)
        _choice("group_size", self.group_size, GROUP_SIZES)
        for flag in ("symmetric", "act_order", "quantize_lm_head", "mse_clip"):
            _choice(flag, getattr(self, flag), (True, False))
        if type(self.damp) is int:  # JSON writes 1.0 back as 1
            object.__setattr__(self, "damp", float(self.damp))
        if type(self.damp) is not float or not 0.0 < self.damp <= 1.0:
            raise QinferError(f"damp must be a float in (0, 1]; got {self.damp!r}")
        if (self.format == "fp8" and self.method not in ("fp8", "gptq")) or (self.format == "int" and self.method == "fp8"):
            raise QinferError(
                f"method {self.method!r} with format {self.format!r}; format 'fp8' goes with method "
                "'fp8' (round to nearest) or 'gptq' (error feedback), format 'int' with rtn, gptq or awq"
            )
        if self.format == "fp8":
            fix = " (fp8 E4M3 weights are 8 bits: use --bits 8 with --format fp8, or --format int for 2, 3, 4 or 8 bits)"
            _choice("bits", self.bits, (8,), fix)
            _choice("lm_head_bits", self.lm_head_bits, (8,), fix)
            if self.group_size != -1:
                raise QinferError("fp8 has no groups; set group_size=-1 and choose fp8_granularity")
            if not self.symmetric:
                raise QinferError("fp8 is symmetric (no zero point): drop --asym (symmetric=True)")
            if self.mse_clip:
                raise QinferError("the clip search (--mse-clip) is for integer formats; fp8 keeps the full range: "
                                 "drop --mse-clip")
        else:
            _choice("bits", self.bits, INT_BITS)
            _choice("lm_head_bits", self.lm_head_bits, INT_BITS)
        if self.act_order and self.method != "gptq":
            raise QinferError(f"act_order (--act-order) applies only to --method gptq, not {self.method!r}: "
                              "drop --act-order")

    @property
    def tag(self) -> str:
        """A short name: ``gptq-w4g128`` (``-w4`` per channel), ``fp8`` (round to nearest), ``gptq-fp8``."""
        if self.format == "fp8":
            return "fp8" if self.method == "fp8" else f"{self.method}-fp8"
        return f"{self.method}-w{self.bits}" + (f"g{self.group_size}" if self.group_size != -1 else "")

    @property
    def maxq(self) -> int:
        """The largest integer code, ``2^bits - 1``."""
        return (1 << self.bits) - 1

    def lm_head_scheme(self) -> QuantScheme:
        """The scheme the lm_head is quantized with when ``quantize_lm_head`` is set."""
        return dataclasses.replace(self, bits=self.lm_head_bits)

    def to_json(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = QUANT_CONFIG_FILE) -> QuantScheme:
        """The scheme ``text`` holds; errors name it as ``source`` (the file's path, where it was read from)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise QinferError(f"{source} is not valid JSON ({e}): the folder is damaged; quantize the model again") \
                from None
        if not isinstance(data, dict):
            raise QinferError(f"{source} must hold a JSON object, not {type(data).__name__}")
        version = data.pop("format_version", None)
        if version is None and {"w_bit", "q_group_size"} & set(data):
            raise QinferError(
                f"{source} is AutoAWQ's (w_bit, q_group_size), not qinfer's: qinfer does not read AutoAWQ "
                "checkpoints; quantize the original model with qinfer (--method awq)"
            )
        if version != FORMAT_VERSION:
            raise QinferError(
                f"{source} has format_version {version!r}; this qinfer reads version {FORMAT_VERSION}"
            )
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise QinferError(f"{source} has unknown keys {unknown}")
        try:
            return cls(**data)
        except QinferError as e:
            raise QinferError(f"{source} is damaged: {e}; quantize the model again") from None

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / QUANT_CONFIG_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, folder: str | Path) -> QuantScheme:
        path = Path(folder) / QUANT_CONFIG_FILE
        if not path.is_file():
            raise QinferError(f"{path} not found: the folder is not a qinfer-quantized checkpoint")
        return cls.from_json(path.read_text(), str(path))


def group_count(K: int, group_size: int) -> int:
    """Number of groups along K: ``K // G``, 1 when per channel."""
    return 1 if group_size == -1 else K // group_size


def check_int_shape(shape: tuple[int, ...], bits: int, group_size: int, name: str = "weight") -> None:
    """Raise a ``QinferError`` naming ``name`` unless a ``[N, K]`` weight fits the integer layout."""
    if len(shape) != 2:
        raise QinferError(f"{name}: expected a 2-D weight [N, K], got shape {tuple(shape)}")
    if min(shape) < 1:
        raise QinferError(f"{name}: a weight of shape {tuple(shape)} has no elements: the checkpoint is damaged")
    K = shape[1]
    if group_size != -1 and K % group_size:
        fits = [g for g in GROUP_SIZES if g != -1 and K % g == 0]
        raise QinferError(
            f"{name}: group_size {group_size} does not divide in_features K={K}; use a group size that divides K"
            f"{f' (--group-size {max(fits)})' if fits else ''} or -1 (per channel)"
        )
    if K * bits % 8:
        raise QinferError(f"{name}: K={K} codes of {bits} bits do not fill whole bytes (need K*bits % 8 == 0)")


# ---------------------------------------------------------------------------------------------- bit packing


def _check_bits(bits: int) -> None:
    if type(bits) is not int or not 1 <= bits <= 8:
        raise QinferError(f"bits must be an integer in 1..8, got {bits!r}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``[..., K]`` (each < 2^bits) into uint8 ``[..., K*bits/8]`` per the module spec."""
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise QinferError(f"pack: codes must be uint8, got {codes.dtype}")
    *lead, K = codes.shape
    if K * bits % 8:
        raise QinferError(f"pack: K={K} codes of {bits} bits do not fill whole bytes")
    if bits == 8:
        return codes.clone()
    if 8 % bits == 0:
        # Whole codes per byte: OR them in with uint8 shifts (the loop runs over the <= 4 slots of a byte).
        per = 8 // bits
        slots = codes.reshape(*lead, K // per, per)
        out = slots[..., 0].clone()
        for j in range(1, per):
            out |= slots[..., j] << (j * bits)
        return out
    # Codes straddle bytes: 8 codes make exactly `bits` bytes. Assemble each 8-code word in an integer wide
    # enough for 8 * bits bits, then split it into bytes. Pad K to a multiple of 8 with zero codes and drop
    # the padding's bytes, which lie past the end of the stream.
    wide = torch.int32 if 8 * bits <= 31 else torch.int64
    pad = -K % 8
    c = torch.nn.functional.pad(codes, (0, pad)).to(wide).reshape(*lead, (K + pad) // 8, 8)
    word = c[..., 0].clone()
    for j in range(1, 8):
        word |= c[..., j] << (j * bits)
    out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(bits)], dim=-1)
    return out.reshape(*lead, (K + pad) * bits // 8)[..., : K * bits // 8].to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., K*bits/8]`` -> uint8 codes ``[..., K]``."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise QinferError(f"unpack: packed must be uint8, got {packed.dtype}")
    *lead, B = packed.shape
    if K * bits % 8 or B != K * bits // 8:
        raise QinferError(f"unpack: {B} bytes per row do not hold K={K} codes of {bits} bits")
    mask = (1 << bits) - 1
    if bits == 8:
        return packed.clone()
    if 8 % bits == 0:
        slots = [(packed >> (j * bits)) & mask for j in range(8 // bits)]
        return torch.stack(slots, dim=-1).reshape(*lead, K)
    wide = torch.int32 if 8 * bits <= 31 else torch.int64
    pad = -K % 8
    b = torch.nn.functional.pad(packed, (0, pad * bits // 8)).to(wide).reshape(*lead, (K + pad) // 8, bits)
    word = b[..., 0].clone()
    for i in range(1, bits):
        word |= b[..., i] << (8 * i)
    codes = torch.stack([(word >> (j * bits)) & mask for j in range(8)], dim=-1)
    return codes.reshape(*lead, K + pad)[..., :K].to(torch.uint8)


# ---------------------------------------------------------------------------------------------- weights


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | int, group_size: int
) -> torch.Tensor:
    """``(q - zero[g(k)]) * scale[g(k)]`` in float32 for codes ``[N, K]`` and ``scale``/``zero`` ``[N, K/G]``.

    ``zero`` may be an int (the implicit symmetric zero).
    """
    K = codes.shape[-1]
    G = K if group_size == -1 else group_size
    # In place on a [..., K/G, G] view, the group's scale and zero broadcast along G: the same values as
    # expanding them to [..., K] first, and faster: no [N, K] temporaries besides the result (docs/results.md,
    # "Figures formerly in code comments").
    w = codes.to(torch.float32, copy=True).unflatten(-1, (K // G, G))
    w.sub_(zero.float().unsqueeze(-1) if isinstance(zero, torch.Tensor) else float(zero))
    return w.mul_(scale.float().unsqueeze(-1)).flatten(-2)


def _expect(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise QinferError(f"{name}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


def _get(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise QinferError(f"missing tensor {key!r} in the quantized checkpoint")
    return tensors[key]


@dataclass(frozen=True)
class QuantizedWeight:
    """An integer-quantized ``[N, K]`` weight in the version-1 layout (see the module docstring).

    ``zero`` is ``None`` for symmetric quantization (implicit zero ``2^(bits-1)``).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group_size: int
    shape: tuple[int, int]
    perm: torch.Tensor | None = None  # stored column j holds input channel perm[j]; None: j itself

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        _choice("bits", self.bits, INT_BITS)
        _choice("group_size", self.group_size, GROUP_SIZES)
        check_int_shape(self.shape, self.bits, self.group_size, "QuantizedWeight")
        N, K = self.shape
        _expect("qweight", self.qweight, torch.uint8, (N, K * self.bits // 8))
        _expect("scale", self.scale, torch.float16, (N, group_count(K, self.group_size)))
        if self.zero is not None:
            _expect("zero", self.zero, torch.uint8, (N, group_count(K, self.group_size)))
        if self.perm is not None:
            _expect("perm", self.perm, torch.int32, (K,))

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def codes(self) -> torch.Tensor:
        """The unpacked codes, uint8 ``[N, K]``, in stored column order."""
        return unpack(self.qweight, self.bits, self.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """``W [N, K]`` with its columns in input-channel order."""
        zero = 1 << (self.bits - 1) if self.zero is None else self.zero
        return self.unpermute(dequantize_codes(self.codes(), self.scale, zero, self.group_size).to(dtype))

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """``dequantize(dtype)[index]`` (``[*index.shape, K]``) from the rows ``index`` alone: a tied
        embedding's lookup."""
        zero = 1 << (self.bits - 1) if self.zero is None else self.zero[index]
        codes = unpack(self.qweight[index], self.bits, self.shape[1])
        return self.unpermute(dequantize_codes(codes, self.scale[index], zero, self.group_size).to(dtype))

    def unpermute(self, stored: torch.Tensor) -> torch.Tensor:
        """``stored [..., K]`` (one value per stored column) with its last dimension in input-channel order."""
        if self.perm is None:
            return stored
        out = torch.empty_like(stored)
        out[..., self.perm.long()] = stored
        return out

    def to(self, device: torch.device | str) -> QuantizedWeight:
        move = None if self.zero is None else self.zero.to(device)
        perm = None if self.perm is None else self.perm.to(device)
        return dataclasses.replace(
            self, qweight=self.qweight.to(device), scale=self.scale.to(device), zero=move, perm=perm
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.qweight": self.qweight, f"{prefix}.scale": self.scale}
        if self.zero is not None:
            out[f"{prefix}.zero"] = self.zero
        if self.perm is not None:
            out[f"{prefix}.perm"] = self.perm
        return out

    @classmethod
    def from_tensors(cls, prefix: str, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantizedWeight:
        """Read ``prefix``'s entries back; pass ``scheme.lm_head_scheme()`` for the lm_head."""
        if scheme.format != "int":
            raise QinferError(f"{prefix}: scheme format is {scheme.format!r}, not 'int'")
        qweight = _get(tensors, f"{prefix}.qweight")
        if qweight.dim() != 2 or qweight.shape[1] * 8 % scheme.bits:
            raise QinferError(f"{prefix}.qweight: shape {list(qweight.shape)} does not hold {scheme.bits}-bit codes")
        zero_key = f"{prefix}.zero"
        if scheme.symmetric and zero_key in tensors:
            raise QinferError(f"{zero_key} present but the scheme is symmetric (checkpoint and quant_config disagree)")
        zero = None if scheme.symmetric else _get(tensors, zero_key)
        shape = (qweight.shape[0], qweight.shape[1] * 8 // scheme.bits)
        perm = tensors.get(f"{prefix}.perm")
        scale = check_scales(_get(tensors, f"{prefix}.scale"), f"{prefix}.scale")
        try:
            w = cls(qweight, scale, zero, scheme.bits, scheme.group_size, shape, perm)
        except QinferError as e:
            raise QinferError(f"{prefix}: {e}") from None
        if perm is not None and not torch.equal(perm.sort().values, torch.arange(shape[1], dtype=perm.dtype)):
            raise QinferError(f"{prefix}.perm: not a permutation of 0..{shape[1] - 1}")
        if zero is not None and zero.numel() and int(zero.max()) >= 1 << scheme.bits:
            raise QinferError(f"{zero_key}: a zero point of {int(zero.max())} is past the {scheme.bits}-bit codes' "
                              f"range [0, {(1 << scheme.bits) - 1}]: the folder is damaged; quantize the model again")
        return w


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 (E4M3) ``[N, K]`` weight with a float32 per-channel ``[N, 1]`` or per-tensor ``[1]`` scale."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        if self.weight.dtype != torch.float8_e4m3fn or self.weight.dim() != 2:
            got = f"{self.weight.dtype} {list(self.weight.shape)}"
            raise QinferError(f"weight: expected float8_e4m3fn [N, K], got {got}")
        N = self.weight.shape[0]
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) not in ((N, 1), (1,)):
            got = f"{self.scale.dtype} {list(self.scale.shape)}"
            raise QinferError(f"scale: expected float32 [{N}, 1] or [1], got {got}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def granularity(self) -> str:
        return "tensor" if self.scale.dim() == 1 else "channel"

    def dequantize(self, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return e4m3_times(self.weight, self.scale).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """``dequantize(dtype)[index]`` (``[*index.shape, K]``) from the rows ``index`` alone."""
        scale = self.scale if self.scale.dim() == 1 else self.scale[index]
        return e4m3_times(self.weight[index], scale).to(dtype)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": self.weight, f"{prefix}.scale": self.scale}

    @classmethod
    def from_tensors(cls, prefix: str, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> Fp8Weight:
        if scheme.format != "fp8":
            raise QinferError(f"{prefix}: scheme format is {scheme.format!r}, not 'fp8'")
        try:
            w = cls(_get(tensors, f"{prefix}.weight"), _get(tensors, f"{prefix}.scale"))
        except QinferError as e:
            raise QinferError(f"{prefix}: {e}") from None
        check_scales(w.scale, f"{prefix}.scale")
        if bool((w.scale.float() > FP8_MAX_SCALE).any()):
            raise QinferError(f"{prefix}.scale holds scales past {FP8_MAX_SCALE:.3g}, whose weights overflow float32: "
                              "the checkpoint is corrupt; re-export or requantize it")
        if bool(((w.weight.view(torch.uint8) & 0x7F) == 0x7F).any()):  # E4M3's only NaN bit patterns
            raise QinferError(f"{prefix}.weight holds NaN codes: the checkpoint is corrupt; re-export or requantize it")
        if w.granularity != scheme.fp8_granularity:
            raise QinferError(
                f"{prefix}.scale: shape {list(w.scale.shape)} is per-{w.granularity}, "
                f"but quant_config says fp8_granularity {scheme.fp8_granularity!r}"
            )
        return w


def e4m3_as_fp16(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``codes`` as fp16 numbers ``value / FP8_SHIFT``, exactly, in three vectorised integer
    passes (PyTorch's ``codes.float()`` converts one element at a time on CPU). The bits move:
    sign to bit 15, the 4-bit exponent and 3-bit mantissa to bits 13..7; fp16's exponent bias is 15 against
    E4M3's 7, so every value drops by 2^-8, and E4M3 subnormals land on fp16 subnormals. For codes that are
    not NaN (0x7F / 0xFF, which would read as 480 / FP8_SHIFT): qinfer saturates every E4M3 it writes and
    refuses a stored weight with NaN codes."""
    bits = codes.view(torch.int8).to(torch.int16)  # sign-extended: bit 15 holds the sign
    bits.bitwise_left_shift_(7)
    bits.bitwise_and_(_SIGN_AND_MAGNITUDE)
    return bits.view(torch.float16)


def e4m3_times(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes.float() * scale`` in float32, bit for bit: the codes as value / 2^8 (exact, fp16), times
    ``scale * 2^8`` (exact), one rounding; without PyTorch's one-element-at-a-time float8 conversion."""
    return e4m3_as_fp16(codes).float() * (scale * FP8_SHIFT)


def check_scales(scale: torch.Tensor, name: str) -> torch.Tensor:
    """``scale``, refused where it holds NaN, an infinity or a negative value (a corrupt checkpoint: such a
    scale would run, giving NaN or wrong outputs instead of an error)."""
    if scale.dtype.is_floating_point and not bool((scale >= 0).logical_and_(scale.isfinite()).all()):
        bad = "NaN" if bool(scale.isnan().any()) else "infinite" if bool(scale.isinf().any()) else "negative"
        raise QinferError(f"{name} holds {bad} scales: the checkpoint is corrupt; re-export or requantize it")
    return scale


def packed_weight(prefix: str, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantizedWeight | Fp8Weight | None:
    """The packed weight stored under ``prefix`` (integer ``P.qweight``, or FP8 ``P.weight`` + ``P.scale``),
    or None when ``prefix`` is not quantized in ``tensors``. ``scheme`` is the one that linear follows."""
    if f"{prefix}.qweight" in tensors:
        return QuantizedWeight.from_tensors(prefix, tensors, scheme)
    weight = tensors.get(f"{prefix}.weight")
    if weight is not None and weight.dtype == torch.float8_e4m3fn and f"{prefix}.scale" in tensors:
        return Fp8Weight.from_tensors(prefix, tensors, scheme)
    return None


def effective_bits(scheme: QuantScheme, shape: tuple[int, int]) -> float:
    """Stored bits per weight of an ``[N, K]`` linear under ``scheme``, scales and zeros included."""
    N, K = shape
    if scheme.format == "fp8":
        scales = N if scheme.fp8_granularity == "channel" else 1
        return 8.0 + 32.0 * scales / (N * K)
    per_group = 16 + (0 if scheme.symmetric else 8)  # fp16 scale (+ uint8 zero)
    return scheme.bits + per_group * group_count(K, scheme.group_size) / K
