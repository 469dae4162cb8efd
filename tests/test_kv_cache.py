from types import SimpleNamespace

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.model.kv_cache import BlockPool, BlockTable, KVCache, OutOfBlocks
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
    _, _, (_, _, k_pos, v_pos) = cache.read(0, 0, 10)
    for x, y, pos in ((k, k_out, k_pos), (v, v_out, v_pos)):
        torch.testing.assert_close(pos, x.abs().amax(-1) / qmax, rtol=1e-6, atol=0)
        step = pos[..., None]
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
    ours, theirs = whole.read(0, 0, 6), alone.read(0, 0, 6)
    for x, y in zip((*ours[:2], *ours[2][2:]), (*theirs[:2], *theirs[2][2:])):  # codes and position scales
        assert torch.equal(x[1:].float(), y.float())


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
        def attend(self, layer, q, k, v, input_pos, start, end, mask, scale):
            reads[layer] = (start, end)  # the cached positions the layer's queries attend over
            return super().attend(layer, q, k, v, input_pos, start, end, mask, scale)

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
    codes, _, (k_scale, _, k_pos, _) = cache.read(0, 0, 300)
    scale = k_scale[None, :, None, :] * k_pos[..., None]
    assert torch.equal(k_out, codes.float() * scale)
    assert int((codes.float().abs() < 2.0**-6).sum()) > 0  # subnormal codes were read


@pytest.fixture
def config():
    return SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16)  # all a cache reads of a ModelConfig


def test_blocks_are_allocated_all_or_none():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(OutOfBlocks, match="2 KV-cache blocks wanted, 1 free of 4"):
        pool.allocate(2)
    assert pool.num_free == 1  # nothing was taken by the refused request


def test_a_shared_block_is_free_only_when_its_last_holder_releases_it():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.share(blocks[:1])
    pool.release(blocks)
    assert pool.num_free == 1 and pool.refs[blocks[0]] == 1
    pool.release(blocks[:1])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="already free"):
        pool.release(blocks[:1])
    with pytest.raises(ValueError, match="is free"):
        pool.share(blocks[:1])


def test_reserve_grows_a_table_block_by_block_and_free_returns_them(config):
    cache = KVCache(config, 0, 8, torch.bfloat16, block_size=8, num_blocks=5)
    table = BlockTable()
    cache.reserve(table, 1)
    assert len(table.blocks) == 1
    cache.reserve(table, 8)
    assert len(table.blocks) == 1
    cache.reserve(table, 17)
    assert len(table.blocks) == 3 and cache.pool.num_free == 2
    with pytest.raises(OutOfBlocks):
        cache.reserve(table, 41)  # 6 blocks: 3 more wanted, 2 free
    assert len(table.blocks) == 3 and cache.pool.num_free == 2
    cache.free(table)
    assert table.blocks == [] and cache.pool.num_free == 5


def test_slots_follow_the_block_tables(config):
    cache = KVCache(config, 0, 8, torch.bfloat16, block_size=8, num_blocks=4)
    cache.bind([BlockTable([3, 0, 2]), BlockTable([1])])
    block, row = cache.slots(torch.tensor([0, 7, 8, 20]))
    assert block[0].tolist() == [3, 3, 0, 2] and row.tolist() == [0, 7, 0, 4]
    assert block[1, :2].tolist() == [1, 1]  # (the second sequence's own positions)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
def test_the_budget_sets_the_number_of_blocks(config, kv_dtype):
    per_block = KVCache.bytes_per_block(config, 16, kv_dtype)
    n = KVCache.blocks_for_memory(config, 10 * per_block + per_block // 2, 16, kv_dtype)
    cache = KVCache(config, 0, 16, torch.bfloat16, kv_dtype=kv_dtype, num_blocks=n)
    assert cache.num_blocks == 10
    held = sum(t.numel() * t.element_size() for t in cache.k + cache.v + cache.k_pos + cache.v_pos)
    assert held == 10 * per_block  # the count is of what the pages really hold
    with pytest.raises(QinferError, match="less than one KV-cache block"):
        KVCache.blocks_for_memory(config, per_block - 1, 16, kv_dtype)


@pytest.mark.parametrize("bad, match", [({"block_size": 12}, "block size 12 is not supported"),
                                        ({"kv_dtype": "int4"}, "unknown KV-cache dtype"),
                                        ({"num_blocks": 0}, "at least one block")])
def test_bad_settings_are_one_line(config, bad, match):
    with pytest.raises(QinferError, match=match):
        KVCache(config, 0, 8, torch.bfloat16, **bad)


def test_scales_of_another_model_are_refused(config):
    wrong = {0: (torch.ones(config.num_kv_heads + 1), torch.ones(config.num_kv_heads + 1))}
    with pytest.raises(QinferError, match="quantize the model again with --kv-cache"):
        KVCache(config, 1, 8, torch.bfloat16, kv_dtype="int8", scales=wrong)


def test_a_sequence_too_long_for_the_free_blocks_is_refused_whole(config):
    cache = KVCache(config, 1, 16, torch.bfloat16, block_size=8, num_blocks=3)
    with pytest.raises(OutOfBlocks):
        cache.new_sequence(17)  # 3 blocks wanted, 1 free
    assert cache.pool.num_free == 1


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
def test_sequences_in_shuffled_blocks_read_back_their_own_positions(config, kv_dtype):
    torch.manual_seed(0)
    Hkv, D, T = config.num_kv_heads, config.head_dim, 37
    cache = KVCache(config, 0, T, torch.float32, kv_dtype=kv_dtype, block_size=8, num_blocks=12)
    a, b = BlockTable([5, 1, 7, 0, 3]), BlockTable([2, 11, 4, 9, 6])
    k, v = torch.randn(2, Hkv, T, D), torch.randn(2, Hkv, T, D)
    cache.bind([a, b])
    expected = cache.update(0, torch.arange(T), k, v)
    cache.bind([b])  # the second sequence alone: its positions as written, the first one's untouched
    alone = cache.update(0, torch.arange(0), k[1:, :, :0], v[1:, :, :0], 0, T)
    for x, y in zip(expected, alone):
        assert torch.equal(x[1:], y)
    if kv_dtype == "bf16":
        assert torch.equal(expected[0], k) and torch.equal(expected[1], v)
