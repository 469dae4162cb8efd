"""A contiguous per-layer KV cache, optionally quantized: the interface the model writes through.

``store`` stores the new keys/values at their positions and returns the cached positions from ``start``
(the first key any of the new queries may see: past a sliding window, the keys before it are never read)
to the newest, as stored, with the layer's scales when the cache is quantized; ``update`` returns them in
the compute dtype. With ``kv_dtype`` "int8" or "fp8" the cache quantizes on write, one scale per layer, KV head
and channel, and attention reads the codes (``qinfer.kernels.attention``: a decode step's C loop folds the
scales into the queries and its sums; other steps dequantize the slice they read):

    int8: q = clamp(round(x / scale), -127, 127)          x ≈ q * scale
    fp8:  q = fp8_e4m3(clamp(x / scale, -448, 448))        x ≈ q * scale

Scales come from calibration (``scales``: {layer: (k_scale, v_scale)}, each [Hkv, D] as ``qinfer quantize
--kv-cache`` stores them, or [Hkv], one per head, as a compressed-tensors import has them); without them a
layer's scales are set on its first write (the prefill), one per head, from that write's absmax times
``UNCALIBRATED_HEADROOM``, so later tokens rarely clip (a short prompt shows too little of each channel's
range to set one per channel). Scales calibrated for
the other dtype (``scales_for``) are the same calibrated absmax over that dtype's QMAX, and are rescaled to
this one's: an int8 cache given FP8 scales as they are would clip everything past 127/448 of the range.

An FP8 cache also doubles calibrated scales (``CALIBRATED_HEADROOM``): E4M3's step is relative to the value,
so moving every code down one binade costs next to nothing, while a key past the calibrated maximum clips.
With gemma3-270m's GPTQ model (8192 tokens of Persuasion, KL to the bf16 cache) it changes nothing with the
default calibration (0.0100 nats either way) and takes scales from a short one (16 x 256 tokens) from 0.0156
to 0.0106; int8's step is absolute, so its calibrated scales stay as they are.
"""

import torch

from qinfer.arch import ModelConfig
from qinfer.errors import QinferError
from qinfer.kernels.attention import dequantize_kv

KV_DTYPES = {"bf16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}
UNCALIBRATED_HEADROOM = 2.0
CALIBRATED_HEADROOM = {"int8": 1.0, "fp8": 2.0}


def check_scale(where, name: str, scale: torch.Tensor, fix: str) -> None:
    """Refuse a stored KV-cache scale that is not finite and positive: NaN or infinity reads every cached key
    back as NaN, and 0 as 0, without a word."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        raise QinferError(f"{where}: {name} holds {float(scale[bad][0]):g}, not a finite positive scale: {fix}")


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device="cpu",
        kv_dtype: str = "bf16",
        scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        scales_for: str | None = None,
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)  # [B, Hkv, S_max, D]
        store = KV_DTYPES[kv_dtype] or dtype
        self.max_len, self.dtype, self.kv_dtype = max_len, dtype, kv_dtype
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(config.num_layers)]
        # per layer: (k_scale, v_scale), each [Hkv, D] fp32; scales_for: the dtype they were calibrated for
        ratio = QMAX[scales_for] / QMAX[kv_dtype] if scales_for in QMAX and kv_dtype in QMAX else 1.0
        ratio *= CALIBRATED_HEADROOM.get(kv_dtype, 1.0)
        self.scales = {i: (self._per_channel(k, device) * ratio, self._per_channel(v, device) * ratio)
                       for i, (k, v) in (scales or {}).items()}

    def store(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
              end: int | None = None):
        # input_pos: [T]; k, v: [B, Hkv, T, D] -> (k, v, scales): cached positions start:end, [B, Hkv, end - start,
        # D], as stored, and (k_scale, v_scale) [Hkv, D] each, or None for a bf16 cache; end is input_pos[-1] + 1
        # (given by a caller that has it as an int)
        end = int(input_pos[-1]) + 1 if end is None else end
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; position {end - 1} does not fit")
        if self.kv_dtype == "bf16":
            self.k[layer][:, :, input_pos] = k
            self.v[layer][:, :, input_pos] = v
            return self.k[layer][:, :, start:end], self.v[layer][:, :, start:end], None
        if layer not in self.scales:
            self.scales[layer] = tuple(self._initial_scale(x) for x in (k, v))
        k_scale, v_scale = self.scales[layer]
        self.k[layer][:, :, input_pos] = self._quantize(k, k_scale)
        self.v[layer][:, :, input_pos] = self._quantize(v, v_scale)
        return self.k[layer][:, :, start:end], self.v[layer][:, :, start:end], self.scales[layer]

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
               end: int | None = None):
        """As :meth:`store`, the cached positions in the compute dtype: (k, v)."""
        k, v, scales = self.store(layer, input_pos, k, v, start, end)
        if scales is None:
            return k, v
        return dequantize_kv(k, scales[0], self.dtype), dequantize_kv(v, scales[1], self.dtype)

    def bytes_per_token(self) -> int:
        """Bytes one cached position occupies across all layers (keys and values)."""
        per_layer = self.k[0][0, :, 0].numel() * self.k[0].element_size() * 2
        return per_layer * len(self.k) * self.k[0].shape[0]

    def _per_channel(self, scale: torch.Tensor, device) -> torch.Tensor:
        # [Hkv] (one per head) or [Hkv, D] -> [Hkv, D] fp32
        Hkv, D = self.k[0].shape[1], self.k[0].shape[3]
        return scale.float().to(device).reshape(Hkv, -1).expand(Hkv, D).contiguous()

    def _initial_scale(self, x: torch.Tensor) -> torch.Tensor:
        absmax = x.detach().abs().amax(dim=(0, 2, 3)).float() * UNCALIBRATED_HEADROOM  # [Hkv]
        scale = torch.where(absmax > 0, absmax / QMAX[self.kv_dtype], torch.ones_like(absmax))
        return self._per_channel(scale, x.device)

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = (x.float() / scale[None, :, None, :]).clamp(-QMAX[self.kv_dtype], QMAX[self.kv_dtype])
        return y.round().to(torch.int8) if self.kv_dtype == "int8" else y.to(torch.float8_e4m3fn)


def make_cache(model, batch: int, max_len: int, kv_dtype: str = "bf16") -> KVCache:
    """A cache for ``model`` (a ``Transformer``) of ``kv_dtype``, with the scales ``qinfer quantize --kv-cache``
    stored in its folder, if any (else each layer's first write sets them)."""
    if kv_dtype not in KV_DTYPES:
        raise QinferError(f"unknown KV-cache dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "bf16":
        return KVCache(model.config, batch, max_len, model.dtype, model.device)
    scales = getattr(model, "kv_scales", None) or None
    return KVCache(model.config, batch, max_len, model.dtype, model.device, kv_dtype=kv_dtype, scales=scales,
                   scales_for=getattr(model, "kv_scales_dtype", None))
