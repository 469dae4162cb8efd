"""A contiguous per-layer KV cache, optionally quantized: the interface the model writes through.

``store`` stores the new keys/values at their positions and returns the cached positions from ``start``
(the first key any of the new queries may see: past a sliding window, the keys before it are never read)
to the newest, as stored, with the layer's scales when the cache is quantized; ``update`` returns them in
the compute dtype. With ``kv_dtype`` "int8" or "fp8" the cache quantizes on write with two scales: one per
layer, KV head and channel (``c``, fixed) and one per position and KV head (``t``, set as each is written, from
its own range), and attention reads the codes (``qinfer.kernels.attention``: a decode step's C loop folds the
channel scales into the queries and its sums and the position scales into its scores and weights; other steps
dequantize the slice they read):

    t = max_d |x_d / c_d| / QMAX                          (QMAX: 127 for int8, 448 for fp8)
    int8: q = round(x / (c t))                            x ≈ q * c * t
    fp8:  q = fp8_e4m3(x / (c t))

The channel scales come from calibration (``scales``: {layer: (k_scale, v_scale)}, each [Hkv, D] as ``qinfer
quantize --kv-cache`` stores them, or [Hkv], one per head, as a compressed-tensors import has them), else are 1:
only their ratios matter here (``t`` takes each position's magnitude), so they keep a few wide channels from
taking the steps of the narrow ones, and scales calibrated for either dtype serve both. Nothing clips, however
far a key lies past what calibration (or the prompt) showed, and a position's codes depend on it alone, not on
the batch or the prompt it came with. The position scales cost 4 bytes per position and KV head each for keys
and values (gemma3-270m's head_dim 256: 1.6% of an int8 cache). On gemma3-270m's GPTQ model a scale per
position lowers an int8 cache's KL to the same model over a bf16 cache against one fixed scale per head, and
calibrated channel scales lower it again (docs/results.md, "Choosing a quantize setting" and "Figures formerly
in code comments").
"""

import torch

from qinfer.model.arch import ModelConfig
from qinfer.errors import QinferError
from qinfer.kernels.attention import dequantize_kv

KV_DTYPES = {"bf16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}


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
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)  # [B, Hkv, S_max, D]
        store = KV_DTYPES[kv_dtype] or dtype
        self.max_len, self.dtype, self.kv_dtype = max_len, dtype, kv_dtype
        # (separate tensors, not views of one: a deep copy of views, as eval --compile makes, does not compile)
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(config.num_layers)]
        # quantized: per layer the channel scales (k_scale, v_scale), each [Hkv, D] fp32 (1 where not calibrated),
        # and the position scales of keys and of values, [B, Hkv, S_max] fp32 each
        self.scales, self.k_pos, self.v_pos = {}, [], []
        if kv_dtype != "bf16":
            ones = torch.ones(shape[1], shape[3], device=device)
            self.scales = {i: tuple(self._per_channel(x, device) for x in scales[i]) if scales and i in scales
                           else (ones, ones) for i in range(config.num_layers)}
            self._divisors = {i: torch.stack(kv)[:, None, :, None, :] for i, kv in self.scales.items()}
            self.k_pos = [torch.ones(shape[:3], device=device) for _ in range(config.num_layers)]
            self.v_pos = [torch.ones(shape[:3], device=device) for _ in range(config.num_layers)]

    def store(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
              end: int | None = None):
        # input_pos: [T]; k, v: [B, Hkv, T, D] -> (k, v, scales): cached positions start:end, [B, Hkv, end - start,
        # D], as stored, and for a quantized cache (k_scale, v_scale, k_pos, v_pos): channel scales [Hkv, D] and
        # position scales [B, Hkv, end - start] (None for a bf16 cache); end is input_pos[-1] + 1 (given by a
        # caller that has it as an int)
        end = int(input_pos[-1]) + 1 if end is None else end
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; position {end - 1} does not fit")
        # a decode step's one position is a slice (a copy), cheaper than an index_put
        at = slice(end - 1, end) if k.shape[2] == 1 else input_pos
        if self.kv_dtype == "bf16":
            self.k[layer][:, :, at], self.v[layer][:, :, at] = k, v
            return self.k[layer][:, :, start:end], self.v[layer][:, :, start:end], None
        codes, pos = self._quantize(torch.stack([k, v]), layer)  # keys and values in one pass
        if not isinstance(at, slice):
            codes = codes.to(self.k[layer].dtype)  # (an index_put takes its source's dtype; a slice's copy converts)
        self.k[layer][:, :, at], self.v[layer][:, :, at] = codes
        self.k_pos[layer][:, :, at], self.v_pos[layer][:, :, at] = pos
        scales = (*self.scales[layer], self.k_pos[layer][:, :, start:end], self.v_pos[layer][:, :, start:end])
        return self.k[layer][:, :, start:end], self.v[layer][:, :, start:end], scales

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
               end: int | None = None):
        """As :meth:`store`, the cached positions in the compute dtype: (k, v)."""
        k, v, scales = self.store(layer, input_pos, k, v, start, end)
        if scales is None:
            return k, v
        k_scale, v_scale, k_pos, v_pos = scales
        return dequantize_kv(k, k_scale, self.dtype, k_pos), dequantize_kv(v, v_scale, self.dtype, v_pos)

    def bytes_per_token(self) -> int:
        """Bytes one cached position occupies across all layers (keys and values, with their position scales)."""
        per_layer = self.k[0][0, :, 0].numel() * self.k[0].element_size() * 2
        if self.k_pos:
            per_layer += self.k_pos[0][0, :, 0].numel() * self.k_pos[0].element_size() * 2
        return per_layer * len(self.k) * self.k[0].shape[0]

    def _per_channel(self, scale: torch.Tensor, device) -> torch.Tensor:
        # [Hkv] (one per head) or [Hkv, D] -> [Hkv, D] fp32
        Hkv, D = self.k[0].shape[1], self.k[0].shape[3]
        return scale.float().to(device).reshape(Hkv, -1).expand(Hkv, D).contiguous()

    def _quantize(self, kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        # kv [2, B, Hkv, T, D] (a fresh tensor: fp32 is divided in place) -> codes (in fp32: integers for int8, the
        # cache's copy rounds them to E4M3 for fp8) and position scales [2, B, Hkv, T]: kv ≈ codes * scale * pos
        qmax = QMAX[self.kv_dtype]
        y = kv.float().div_(self._divisors[layer])
        pos = y.abs().amax(dim=-1).clamp_min_(1e-30).div_(qmax)  # (an all-zero position: codes 0)
        y = y.div_(pos[..., None])  # the largest |y| is qmax, to a rounding: nothing clips
        return (y.round_() if self.kv_dtype == "int8" else y), pos


def make_cache(model, batch: int, max_len: int, kv_dtype: str = "bf16") -> KVCache:
    """A cache for ``model`` (a ``Transformer``) of ``kv_dtype``, with the channel scales ``qinfer quantize
    --kv-cache`` stored in its folder, if any."""
    if kv_dtype not in KV_DTYPES:
        raise QinferError(f"unknown KV-cache dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "bf16":
        return KVCache(model.config, batch, max_len, model.dtype, model.device)
    scales = getattr(model, "kv_scales", None) or None
    return KVCache(model.config, batch, max_len, model.dtype, model.device, kv_dtype=kv_dtype, scales=scales)
