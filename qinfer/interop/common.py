"""What the interop converters share: int32 word streams, exact float16 scales, tensor lookups.

Both GPTQ and compressed-tensors store codes as a *dense little-endian bit stream in int32 words*: code
``i`` of a packed line occupies stream bits ``[i*b, (i+1)*b)``, least significant bit first, and stream bit
``j`` is the bit of value ``2^(j % 32)`` in word ``j // 32`` (read as an unsigned 32-bit integer; the
tensors are int32, so a word with bit 31 set is negative). That is qinfer's byte stream (see
:mod:`qinfer.format`) read four bytes at a time, least significant byte first. The conversion here is
arithmetic, not a ``view``, so it does not depend on the host's byte order.
"""

from __future__ import annotations

import torch

from qinfer.errors import QinferError
from qinfer.format import check_scales, pack, unpack


def stream_to_words(stream: torch.Tensor) -> torch.Tensor:
    """uint8 bit stream ``[..., B]`` -> int32 words ``[..., ceil(B / 4)]``, zero bits past the stream's end."""
    *lead, B = stream.shape
    b = torch.nn.functional.pad(stream, (0, -B % 4)).to(torch.int64).reshape(*lead, -1, 4)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def words_to_stream(words: torch.Tensor, nbytes: int) -> torch.Tensor:
    """int32 words ``[..., W]`` -> the first ``nbytes`` (<= 4 W) bytes of their bit stream, uint8 ``[..., nbytes]``."""
    *lead, W = words.shape
    if nbytes > 4 * W:
        raise QinferError(f"{W} int32 words per line hold {4 * W} bytes, not the {nbytes} the shape needs")
    w = words.to(torch.int64) & 0xFFFFFFFF
    b = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    return b.reshape(*lead, 4 * W)[..., :nbytes].to(torch.uint8)


def word_count(count: int, bits: int) -> int:
    """Words that hold ``count`` values of ``bits`` bits: ``ceil(count * bits / 32)``."""
    return -(-count * bits // 32)


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values ``[..., C]`` (each < 2^bits) -> int32 words ``[..., ceil(C * bits / 32)]``, one stream per line."""
    C = values.shape[-1]
    stream = pack(torch.nn.functional.pad(values, (0, -C % 8)), bits)  # whole bytes; padding values are 0
    return stream_to_words(stream)[..., : word_count(C, bits)]


def unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: the first ``count`` values of each line, uint8 ``[..., count]``."""
    if words.shape[-1] != word_count(count, bits):
        raise QinferError(f"{words.shape[-1]} int32 words per line do not hold {count} values of {bits} bits")
    padded = -(-count // 8) * 8  # unpack whole bytes: pad the stream with zero bytes past its end
    stream = words_to_stream(words, min(4 * words.shape[-1], padded * bits // 8))
    stream = torch.nn.functional.pad(stream, (0, padded * bits // 8 - stream.shape[-1]))
    return unpack(stream, bits, padded)[..., :count]


def exact_fp16(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as float16, refusing a value the cast would change (qinfer stores float16 scales)."""
    if not t.dtype.is_floating_point:
        raise QinferError(f"{name}: expected floating-point scales, got {t.dtype}")
    check_scales(t, name)
    if t.dtype == torch.float16:
        return t
    h = t.half()
    if not torch.equal(h.to(t.dtype), t):
        raise QinferError(
            f"{name}: {t.dtype} scales that float16 cannot hold exactly (out of range or too precise); "
            "qinfer stores float16 scales, so requantize the model with qinfer instead of converting it"
        )
    return h


def get_tensor(tensors: dict[str, torch.Tensor], key: str, dtype: torch.dtype | None, ndim: int) -> torch.Tensor:
    """``tensors[key]``, checked for dtype and rank; a missing or mistyped tensor is a ``QinferError``."""
    if key not in tensors:
        raise QinferError(f"missing tensor {key!r} in the checkpoint")
    t = tensors[key]
    if dtype is not None and t.dtype != dtype:
        raise QinferError(f"{key}: expected {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise QinferError(f"{key}: expected {ndim} dimensions, got shape {list(t.shape)}")
    return t


def static_group_index(K: int, group_size: int) -> torch.Tensor:
    """``g_idx[k] = k // G`` (int32 ``[K]``), all zeros per channel: static groups, the stored columns' grouping."""
    G = K if group_size == -1 else group_size
    return torch.arange(K, dtype=torch.int32) // G


def group_order(g_idx: torch.Tensor, K: int, group_size: int, name: str) -> torch.Tensor | None:
    """The format's ``perm`` for a checkpoint's ``g_idx`` (the group of each input channel): None for static
    groups (``k // G``), else the channels sorted by group (stable; int32). Act-order without static groups
    puts exactly G channels in each group; a ``g_idx`` that does not is refused."""
    G = K if group_size == -1 else group_size
    if tuple(g_idx.shape) != (K,) or g_idx.dtype.is_floating_point:
        raise QinferError(f"{name}: expected an integer [{K}] group index, got {g_idx.dtype} {list(g_idx.shape)}")
    g, static = g_idx.long(), static_group_index(K, group_size).long()
    if torch.equal(g, static):
        return None
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], static):
        raise QinferError(f"{name}: g_idx does not put {G} input channels in each of {K // G} groups")
    return perm.to(torch.int32)
