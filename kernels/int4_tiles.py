"""The 4- and 8-bit codes in ``gemv_cpu.c``'s output-interleaved layouts (its AVX512-VNNI loop for M rows), built
once per weight, and their inverses.

The output rows are taken 16 at a time (a tile; N padded up to a multiple of 16 with codes 0 and scale 0). Tile t
holds, per group g and per 8 columns k = g G + 8 c of the group, one 64-byte vector: 4 bytes per output row j (lane j
of 16 int32 lanes, row n = 16 t + j), byte b holding code ``q[n, k + b]`` in its low nibble and ``q[n, k + 4 + b]``
in its high one. So a vector's low nibbles are 16 rows x 4 columns as bytes, its high nibbles the next 4 columns:
one VPDPBUSD each against a row's 4 activations broadcast. ``codes``: uint8 ``[T, 8 K]`` (tile after tile, groups
and their vectors in order). ``scale_zero``: fp32 ``[T, K/G, 2, 16]``, each tile's 16 scales then its 16 zero points
per group (symmetric codes: 8), exact copies of the fp16 scales and uint8 zeros.

8-bit codes (:func:`tile_int8`): the same tiles, each 64-byte vector 16 output rows x 4 columns of codes as bytes
(lane j: ``q[16 t + j, k..k+4]``, k = g G + 4 c), one VPDPBUSD against a row's 4 activations; ``codes``: uint8
``[T, 16 K]``; ``scale_zero`` as above (symmetric codes: 128).
"""

import torch

from qinfer.format import pack, unpack


def tile_int4(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, G: int):
    """``(codes, scale_zero)`` of 4-bit ``qweight`` [N, K/2] (stored order), ``scale`` [N, K/G] and ``zero`` (or
    None), in the layout the module docstring gives. K % G == 0 and G % 8 == 0."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    T, ng = -(-N // 16), K // G
    q = torch.zeros(T * 16, K, dtype=torch.uint8)
    q[:N] = unpack(qweight, 4, K)
    q = q.view(T, 16, ng, G // 8, 2, 4)  # [t, j, g, c, half, b]
    codes = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous().view(T, 8 * K)
    return codes, _scale_zero(scale, zero, N, T, ng, 8.0)


def _scale_zero(scale: torch.Tensor, zero: torch.Tensor | None, N: int, T: int, ng: int, symmetric_zero: float):
    """Each tile's 16 scales, then its 16 zero points, per group: fp32 [T, ng, 2, 16] (padded rows: 0 and 0)."""
    sz = torch.zeros(T * 16, ng, 2, dtype=torch.float32)
    sz[:N, :, 0] = scale.float()
    sz[:N, :, 1] = symmetric_zero if zero is None else zero.float()
    return sz.view(T, 16, ng, 2).permute(0, 2, 3, 1).contiguous()


def untile_int4(codes: torch.Tensor, scale_zero: torch.Tensor, N: int, K: int, G: int):
    """Inverse of :func:`tile_int4`: ``(qweight, scale, zero)``, scale in fp16 and zero as uint8 (the symmetric
    weight's 8s included)."""
    T, ng = codes.shape[0], K // G
    v = codes.view(T, ng, G // 8, 16, 4).permute(0, 3, 1, 2, 4)  # [t, j, g, c, b]
    q = torch.stack([v & 0xF, v >> 4], dim=-2).reshape(T * 16, K)[:N]
    sz = scale_zero.permute(0, 3, 1, 2).reshape(T * 16, ng, 2)[:N]
    return pack(q, 4), sz[..., 0].half(), sz[..., 1].to(torch.uint8)


def tile_int8(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, G: int):
    """``(codes, scale_zero)`` of 8-bit ``qweight`` [N, K], ``scale`` [N, K/G] and ``zero`` (or None), in the 8-bit
    layout the module docstring gives. K % G == 0 and G % 4 == 0."""
    N, K = qweight.shape
    T, ng = -(-N // 16), K // G
    q = torch.zeros(T * 16, K, dtype=torch.uint8)
    q[:N] = qweight
    codes = q.view(T, 16, K // 4, 4).permute(0, 2, 1, 3).contiguous().view(T, 16 * K)
    return codes, _scale_zero(scale, zero, N, T, ng, 128.0)


def untile_int8(codes: torch.Tensor, scale_zero: torch.Tensor, N: int, K: int, G: int):
    """Inverse of :func:`tile_int8`: ``(qweight, scale, zero)``, scale in fp16 and zero as uint8 (the symmetric
    weight's 128s included)."""
    T, ng = codes.shape[0], K // G
    q = codes.view(T, K // 4, 16, 4).permute(0, 2, 1, 3).reshape(T * 16, K)[:N]
    sz = scale_zero.permute(0, 3, 1, 2).reshape(T * 16, ng, 2)[:N]
    return q.contiguous(), sz[..., 0].half(), sz[..., 1].to(torch.uint8)
