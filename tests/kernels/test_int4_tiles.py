"""The 4- and 8-bit codes' tile layouts (``qinfer.kernels.int4_tiles``): exact round trips, and where each code
sits."""

import pytest
import torch

from qinfer.format import pack
from qinfer.kernels.int4_tiles import tile_int4, tile_int8, untile_int4, untile_int8


@pytest.mark.parametrize("N,K,G", [(37, 256, 128), (16, 640, 64), (5, 512, 512), (1024, 640, 128)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_tiles_round_trip_exactly(N, K, G, symmetric):
    g = torch.Generator().manual_seed(N + K)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
    scale = torch.rand(N, K // G, generator=g).half()
    zero = None if symmetric else torch.randint(0, 16, (N, K // G), dtype=torch.uint8, generator=g)
    codes, scale_zero = tile_int4(pack(q, 4), scale, zero, G)
    assert codes.shape == (-(-N // 16), 8 * K) and scale_zero.shape == (-(-N // 16), K // G, 2, 16)
    qweight, s, z = untile_int4(codes, scale_zero, N, K, G)
    assert torch.equal(qweight, pack(q, 4)) and torch.equal(s, scale)
    assert torch.equal(z, torch.full_like(z, 8) if zero is None else zero)
    # row n = 16 t + j, columns k..k+3 (k = g G + 8 c) in the low nibbles of lane j of the vector, k+4..k+7 high
    t, j, k = (N - 1) // 16, (N - 1) % 16, K - 8
    lane = codes[t].view(K // 8, 16, 4)[k // 8, j]
    assert torch.equal(lane & 0xF, q[N - 1, k:k + 4]) and torch.equal(lane >> 4, q[N - 1, k + 4:k + 8])
    # padded rows: codes 0, scale 0
    assert not scale_zero.permute(0, 3, 1, 2).reshape(-1, K // G, 2)[N:, :, 0].any()


@pytest.mark.parametrize("N,K,G", [(37, 256, 128), (16, 640, 64), (5, 512, 512), (1024, 640, 16)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_tiles_round_trip_exactly(N, K, G, symmetric):
    g = torch.Generator().manual_seed(N + K)
    q = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=g)
    scale = torch.rand(N, K // G, generator=g).half()
    zero = None if symmetric else torch.randint(0, 256, (N, K // G), dtype=torch.uint8, generator=g)
    codes, scale_zero = tile_int8(q, scale, zero, G)
    assert codes.shape == (-(-N // 16), 16 * K) and scale_zero.shape == (-(-N // 16), K // G, 2, 16)
    qweight, s, z = untile_int8(codes, scale_zero, N, K, G)
    assert torch.equal(qweight, q) and torch.equal(s, scale)
    assert torch.equal(z, torch.full_like(z, 128) if zero is None else zero)
    # row n = 16 t + j, columns k..k+3 (k = g G + 4 c) as the 4 bytes of lane j of the vector
    t, j, k = (N - 1) // 16, (N - 1) % 16, K - 4
    assert torch.equal(codes[t].view(K // 4, 16, 4)[k // 4, j], q[N - 1, k:k + 4])
    assert not scale_zero.permute(0, 3, 1, 2).reshape(-1, K // G, 2)[N:, :, 0].any()
