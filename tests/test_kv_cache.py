import pytest
import torch

from qinfer.kv_cache import KVCache
from qinfer.loader import load_model
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_model("llama", folder)
    return load_model(folder, dtype=torch.float32)


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_quantized_cache_round_trip_error_is_bounded(tiny, kv_dtype, bound):
    cache = KVCache(tiny.config, 1, 16, torch.float32, kv_dtype=kv_dtype)
    k, v = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    k_out, v_out = cache.update(0, torch.arange(10), k, v)
    k_scale = cache.scales[0][0]
    assert k_scale.shape == (2, 16)  # uncalibrated: one per head (the prompt's range), for each channel
    assert torch.equal(k_scale, k_scale[:, :1].expand(2, 16))
    # int8: half a step of the scale; fp8: 3 mantissa bits (relative), plus a subnormal floor
    for x, y, s in ((k, k_out, k_scale), (v, v_out, cache.scales[0][1])):
        err = (x - y).abs()
        limit = s[None, :, None, :] / 2 if kv_dtype == "int8" else bound * x.abs() + s[None, :, None, :] * 2.0**-9
        assert bool((err <= limit * 1.0001).all())
    assert cache.k[0].dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]


def test_calibrated_scales_are_used_and_bytes_shrink(tiny):
    scales = {i: (torch.full((2,), 0.01), torch.full((2,), 0.02)) for i in range(tiny.config.num_layers)}
    cache = KVCache(tiny.config, 1, 8, torch.float32, kv_dtype="int8", scales=scales)
    k = torch.full((1, 2, 1, 16), 5.0)  # 5 / 0.01 = 500 -> clipped to 127 * 0.01
    k_out, _ = cache.update(0, torch.tensor([0]), k, k)
    assert torch.allclose(k_out, torch.full_like(k, 1.27))
    dense = KVCache(tiny.config, 1, 8, torch.bfloat16)
    assert cache.bytes_per_token() * 2 == dense.bytes_per_token()



def test_fp8_cache_keeps_headroom_past_the_calibrated_range(tiny):
    # calibration sees a sample of the text: a key 1.5x past its maximum clips at int8's scale, which stays as
    # calibrated (its step is absolute), and passes an FP8 cache, which doubles it (its step is relative)
    absmax = torch.rand(2, 16) + 0.5
    k = (absmax * 1.5)[None, :, None, :] * torch.tensor([1.0, -1.0, 0.25])[None, None, :, None]  # [1, 2, 3, 16]
    for kv_dtype, qmax, headroom in (("int8", 127.0, 1.0), ("fp8", 448.0, 2.0)):
        scales = {i: (absmax / qmax, absmax / qmax) for i in range(tiny.config.num_layers)}
        cache = KVCache(tiny.config, 1, 4, torch.float32, kv_dtype=kv_dtype, scales=scales)
        torch.testing.assert_close(cache.scales[0][0], absmax / qmax * headroom, rtol=1e-6, atol=0)
        k_out, _ = cache.update(0, torch.arange(3), k, k)
        if kv_dtype == "int8":
            torch.testing.assert_close(k_out[:, :, 0], absmax[None], rtol=1e-6, atol=0)  # clipped
        else:
            assert bool(((k_out - k).abs() <= k.abs() * 2.0**-4).all())  # within E4M3's half step


@pytest.mark.parametrize("kv_dtype,qmax", [("int8", 127.0), ("fp8", 448.0)])
def test_per_channel_scales_quantize_each_channel_on_its_own_range(tiny, kv_dtype, qmax):
    # channels whose ranges differ 10^5-fold, as a few outlier channels make them: one scale per head rounds
    # the small channels to a few int8 steps or FP8's subnormals; per channel, each keeps its relative precision
    ranges = torch.logspace(-5, 0, 16)  # [D]
    k = torch.randn(1, 2, 10, 16) * ranges
    absmax = k.abs().amax(dim=(0, 2))  # [Hkv, D]
    scales = {i: (absmax / qmax, absmax / qmax) for i in range(tiny.config.num_layers)}
    cache = KVCache(tiny.config, 1, 10, torch.float32, kv_dtype=kv_dtype, scales=scales)
    k_out, _ = cache.update(0, torch.arange(10), k, k)
    rel = ((k_out - k).norm(dim=2) / k.norm(dim=2)).max()  # worst channel's relative error
    assert float(rel) < (0.01 if kv_dtype == "int8" else 0.05)
    per_head = KVCache(tiny.config, 1, 10, torch.float32, kv_dtype=kv_dtype,
                       scales={i: (absmax.amax(1) / qmax,) * 2 for i in range(tiny.config.num_layers)})
    assert per_head.scales[0][0].shape == (2, 16)  # [Hkv] (a compressed-tensors import's) is broadcast
    k_head, _ = per_head.update(0, torch.arange(10), k, k)
    assert float(((k_head - k).norm(dim=2) / k.norm(dim=2)).max()) > 5 * float(rel)


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
    cache = KVCache(tiny.config, 1, 300, torch.float32, kv_dtype="fp8")
    k = torch.randn(1, 2, 300, 16) * torch.logspace(-6, 1, 300)[None, None, :, None]
    k_out, _ = cache.update(0, torch.arange(300), k, k)
    scale = cache.scales[0][0]
    assert torch.equal(k_out, cache.k[0].float() * scale[None, :, None, :])
    assert int((cache.k[0].float().abs() < 2.0**-6).sum()) > 0  # subnormal codes were read
