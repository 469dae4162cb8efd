import pytest
import torch

from qinfer.model.kv_cache import KVCache
from qinfer.model.loader import load_model
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


@pytest.mark.parametrize("kv_dtype,qmax", [("int8", 127.0), ("fp8", 448.0)])
def test_quantized_cache_round_trip_error_is_bounded_per_position(tiny, kv_dtype, qmax):
    cache = KVCache(tiny.config, 1, 16, torch.float32, kv_dtype=kv_dtype)
    # positions whose ranges differ 10^4-fold: each is quantized on its own
    k, v = (torch.randn(1, 2, 10, 16) * torch.logspace(-4, 0, 10)[:, None] for _ in range(2))
    k_out, v_out = cache.update(0, torch.arange(10), k, v)
    assert torch.equal(cache.scales[0][0], torch.ones(2, 16))  # uncalibrated: channels alike
    for x, y, pos in ((k, k_out, cache.k_pos[0]), (v, v_out, cache.v_pos[0])):
        torch.testing.assert_close(pos[:, :, :10], x.abs().amax(-1) / qmax, rtol=1e-6, atol=0)
        step = pos[:, :, :10, None]
        # int8: half a step; fp8: 3 mantissa bits (relative), plus a subnormal floor
        limit = step / 2 if kv_dtype == "int8" else 2.0**-4 * x.abs() + step * 2.0**-9
        assert bool(((x - y).abs() <= limit * 1.0001).all())
    assert cache.k[0].dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_position_is_quantized_alone(tiny, kv_dtype):
    # a position's codes and scale depend on its own keys and values: not on the prompt it came in, the batch
    # beside it, or the order of the writes
    k, v = torch.randn(2, 2, 6, 16) * 3, torch.randn(2, 2, 6, 16)
    whole = KVCache(tiny.config, 2, 8, torch.float32, kv_dtype=kv_dtype)
    whole.store(0, torch.arange(6), k, v)
    alone = KVCache(tiny.config, 1, 8, torch.float32, kv_dtype=kv_dtype)
    for t in range(6):
        alone.store(0, torch.tensor([t]), k[1:, :, t : t + 1], v[1:, :, t : t + 1])
    for ours, theirs in ((whole.k, alone.k), (whole.v, alone.v), (whole.k_pos, alone.k_pos)):
        assert torch.equal(ours[0][1:, :, :6].float(), theirs[0][:, :, :6].float())


def test_calibrated_scales_shape_the_channels_and_nothing_clips(tiny):
    scales = {i: (torch.full((2,), 0.01), torch.full((2,), 0.02)) for i in range(tiny.config.num_layers)}
    cache = KVCache(tiny.config, 1, 8, torch.float32, kv_dtype="int8", scales=scales)
    k = torch.full((1, 2, 1, 16), 5.0)  # 5 / 0.01 = 500 codes past the calibrated range: the position's scale takes it
    k_out, _ = cache.update(0, torch.tensor([0]), k, k)
    torch.testing.assert_close(k_out, k, rtol=1e-6, atol=0)
    dense = KVCache(tiny.config, 1, 8, torch.bfloat16)
    D, layers, kv_heads = 16, tiny.config.num_layers, 2
    assert dense.bytes_per_token() == layers * kv_heads * 2 * D * 2
    assert cache.bytes_per_token() == layers * kv_heads * 2 * (D + 4)  # codes and a position's fp32 scale


@pytest.mark.parametrize("kv_dtype,qmax", [("int8", 127.0), ("fp8", 448.0)])
def test_per_channel_scales_quantize_each_channel_on_its_own_range(tiny, kv_dtype, qmax):
    # channels whose ranges differ 10^5-fold, as a few outlier channels make them: a scale per position and
    # head alone rounds the small channels to a few int8 steps or FP8's subnormals; calibrated scales per
    # channel keep each channel's relative precision
    ranges = torch.logspace(-5, 0, 16)  # [D]
    k = torch.randn(1, 2, 10, 16) * ranges
    absmax = k.abs().amax(dim=(0, 2))  # [Hkv, D]
    layers = tiny.config.num_layers
    cache = KVCache(tiny.config, 1, 10, torch.float32, kv_dtype=kv_dtype,
                    scales={i: (absmax / qmax, absmax / qmax) for i in range(layers)})
    k_out, _ = cache.update(0, torch.arange(10), k, k)
    rel = ((k_out - k).norm(dim=2) / k.norm(dim=2)).max()  # worst channel's relative error
    assert float(rel) < (0.01 if kv_dtype == "int8" else 0.05)
    for scales in (None, {i: (absmax.amax(1) / qmax,) * 2 for i in range(layers)}):  # none; one per head
        coarse = KVCache(tiny.config, 1, 10, torch.float32, kv_dtype=kv_dtype, scales=scales)
        assert coarse.scales[0][0].shape == (2, 16)  # [Hkv] (a compressed-tensors import's) is broadcast
        k_coarse, _ = coarse.update(0, torch.arange(10), k, k)
        assert float(((k_coarse - k).norm(dim=2) / k.norm(dim=2)).max()) > 5 * float(rel)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_decoding_stays_close(tiny, kv_dtype):
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        full = tiny(ids)
        cache = KVCache(tiny.config, 1, 12, torch.float32, kv_dtype=kv_dtype)
        steps = [tiny(ids[:, :6], torch.arange(6), cache)]
        steps += [tiny(ids[:, t : t + 1], torch.tensor([t]), cache) for t in range(6, 12)]
    got = torch.cat(steps, dim=1)
    assert float((got - full).norm() / full.norm()) < 0.05


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_update_returns_positions_from_start(tiny, kv_dtype):
    cache = KVCache(tiny.config, 1, 16, torch.float32, kv_dtype=kv_dtype)
    k, v = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    k_all, v_all = cache.update(0, torch.arange(10), k, v)
    k_new, v_new = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    k_tail, v_tail = cache.update(0, torch.tensor([10]), k_new, v_new, start=4)
    assert k_tail.shape == (1, 2, 7, 16)  # positions 4..10
    torch.testing.assert_close(k_tail[:, :, :6], k_all[:, :, 4:])
    torch.testing.assert_close(v_tail[:, :, :6], v_all[:, :, 4:])


def test_sliding_window_layers_read_only_their_window(tmp_path):
    # gemma3's tiny model: sliding window 5 on most layers, full attention on the others
    make_model("gemma3", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    windows = model.config.sliding_window
    reads = {}

    class Recording(KVCache):
        def store(self, layer, input_pos, k, v, start=0, end=None):
            k_out, v_out, scales = super().store(layer, input_pos, k, v, start, end)
            reads[layer] = (start, start + k_out.shape[2])  # the cached positions handed to the layer
            return k_out, v_out, scales

    cache = Recording(model.config, 1, 16, torch.float32)
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        # a prompt in two chunks (the second's first query, position 7, sees keys 3..7), then a decode step
        for positions, first_key in ((torch.arange(7), 0), (torch.arange(7, 11), 7 - 5 + 1), (torch.tensor([11]), 11 - 5 + 1)):
            model(ids[:, positions], positions, cache)
            end = int(positions[-1]) + 1
            assert {reads[i] for i, w in enumerate(windows) if w is None} == {(0, end)}
            assert {reads[i] for i, w in enumerate(windows) if w is not None} == {(first_key, end)}


def test_masks_follow_their_definition(tmp_path):
    # [T, S] True where key position k may be seen from query position q: k <= q, and q - k < window
    make_model("gemma3", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    for input_pos, n_keys in ((torch.arange(12), 0), (torch.arange(7, 12), 12), (torch.tensor([20]), 21)):
        q = input_pos[:, None]
        k = torch.arange(n_keys)[None, :] if n_keys else input_pos[None, :]
        masks = model.masks(input_pos, n_keys)
        assert set(masks) == set(model.config.sliding_window)
        for window, mask in masks.items():
            expected = torch.tensor([[kk <= qq and (window is None or qq - kk < window) for kk in k[0].tolist()]
                                     for qq in q[:, 0].tolist()])
            assert torch.equal(mask, expected)


def test_fp8_cache_reads_exactly_codes_times_scale(tiny):
    # the fp8 read moves code bits into fp16 (float8 -> float converts one element at a time in torch);
    # it must give exactly code * scale, subnormal codes included
    scales = {i: (torch.rand(2, 16) + 0.5,) * 2 for i in range(tiny.config.num_layers)}
    cache = KVCache(tiny.config, 1, 300, torch.float32, kv_dtype="fp8", scales=scales)
    k = torch.randn(1, 2, 300, 16) * torch.logspace(-6, 1, 16)
    k_out, _ = cache.update(0, torch.arange(300), k, k)
    scale = cache.scales[0][0][None, :, None, :] * cache.k_pos[0][..., None]
    assert torch.equal(k_out, cache.k[0].float() * scale)
    assert int((cache.k[0].float().abs() < 2.0**-6).sum()) > 0  # subnormal codes were read
