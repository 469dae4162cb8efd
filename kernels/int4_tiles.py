"""The 4-bit codes in ``gemv_cpu.c``'s output-interleaved layout (its AVX512-VNNI loop for M rows), built once per
weight, and its inverse.

The output rows are taken 16 at a time (a tile; N padded up to a multiple of 16 with codes 0 and scale 0). Tile t
holds, per group g and per 8 columns k = g G + 8 c of the group, one 64-byte vector: 4 bytes per output row j (lane j
of 16 int32 lanes, row n = 16 t + j), byte b holding code ``q[n, k + b]`` in its low nibble and ``q[n, k + 4 + b]``
in its high one. So a vector's low nibbles are 16 rows x 4 columns as bytes, its high nibbles the next 4 columns:
one VPDPBUSD each against a row's 4 activations broadcast. ``codes``: uint8 ``[T, 8 K]`` (tile after tile, groups
and their vectors in order). ``scale_zero``: fp32 ``[T, K/G, 2, 16]``, each tile's 16 scales then its 16 zero points
per group (symmetric codes: 8), exact copies of the fp16 scales and uint8 zeros.
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
    sz = torch.zeros(T * 16, ng, 2, dtype=torch.float32)
    sz[:N, :, 0] = scale.float()
    sz[:N, :, 1] = 8.0 if zero is None else zero.float()
    scale_zero = sz.view(T, 16, ng, 2).permute(0, 2, 3, 1).contiguous()
    return codes, scale_zero


def untile_int4(codes: torch.Tensor, scale_zero: torch.Tensor, N: int, K: int, G: int):
    """Inverse of :func:`tile_int4`: ``(qweight, scale, zero)``, scale in fp16 and zero as uint8 (the symmetric
    weight's 8s included)."""
    T, ng = codes.shape[0], K // G
    v = codes.view(T, ng, G // 8, 16, 4).permute(0, 3, 1, 2, 4)  # [t, j, g, c, b]
    q = torch.stack([v & 0xF, v >> 4], dim=-2).reshape(T * 16, K)[:N]
    sz = scale_zero.permute(0, 3, 1, 2).reshape(T * 16, ng, 2)[:N]
    return pack(q, 4), sz[..., 0].half(), sz[..., 1].to(torch.uint8)
