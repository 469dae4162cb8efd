import contextlib
import os
import shutil
from collections import Counter

import pytest
import torch
from safetensors import safe_open

from qinfer.evals.checkpoint import content_key, effective_bits, size_on_disk
from qinfer.evals.costs import decode_bytes, decode_flops, prefill_flops, prefill_flops_by_dtype, weight_bytes
from qinfer.evals.report import REPORT_FILES
from qinfer.format import QuantScheme
from qinfer.kernels import cpu_library, dense, int4_cpu
from qinfer.model.kv_cache import make_cache
from qinfer.model.loader import is_bos_tensor, load_model
from qinfer.model.decoder import QLinear
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from tests.evals.eval_fixtures import tiny_model


RTN_G32 = QuantScheme(method="rtn", bits=4, group_size=32)
FP8 = QuantScheme(method="fp8", bits=8, group_size=-1, format="fp8")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("costs")
    ref = tiny_model(root / "ref")
    quantize_model(ref, root / "rtn", RTN_G32, CalibConfig(samples=2, seq_len=16))
    quantize_model(ref, root / "fp8", FP8, CalibConfig(samples=2, seq_len=16))
    head = QuantScheme(method="rtn", bits=4, group_size=32, quantize_lm_head=True, lm_head_bits=8)
    quantize_model(ref, root / "rtn_head", head, CalibConfig(samples=2, seq_len=16))
    return {"ref": ref, "rtn": root / "rtn", "fp8": root / "fp8", "rtn_head": root / "rtn_head"}


def _stored_bytes(folder) -> int:
    """Bytes of the stored tensors a decode step reads: all but the BOS position's (read where a prompt starts)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys = [k for k in f.keys() if not is_bos_tensor(k)]
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
    return total


@pytest.mark.parametrize("name", ["ref", "rtn", "fp8", "rtn_head"])
def test_decode_reads_every_stored_tensor_once_and_one_embedding_row(folders, name):
    # Tied model: the stored tensors are the embedding, the norms and the linears; a decode step reads all of
    # them (the lm_head matmul reads the whole embedding matrix) plus the embedding row of its token. A
    # quantized lm_head is stored instead of the embedding, which reads its token's packed row: 8-bit codes
    # and an fp16 scale per group of 32.
    model = load_model(folders[name])
    cache = make_cache(model, 1, 8, "bf16")
    C = model.config.hidden_size
    row = C + C // 32 * 2 if name == "rtn_head" else C * 2
    assert decode_bytes(model, cache, 0) == _stored_bytes(folders[name]) + row


def test_kv_bytes_grow_per_position_and_about_halve_in_int8(folders):
    model = load_model(folders["ref"])
    c = model.config
    assert None in c.sliding_window and any(c.sliding_window)  # both kinds of layer are counted
    bf16, int8 = make_cache(model, 1, 8, "bf16"), make_cache(model, 1, 8, "int8")
    per_position = 2 * c.num_kv_heads * c.head_dim  # keys and values of one layer
    for context in (3, 100):
        # a full-attention layer reads every cached position, a sliding one the window - 1 newest
        read = sum(context if w is None else min(context, w - 1) for w in c.sliding_window)
        assert decode_bytes(model, bf16, context) - decode_bytes(model, bf16, 0) == read * per_position * 2
        # int8: a byte per element, and each position's fp32 scale per KV head for keys and for values
        int8_position = 2 * c.num_kv_heads * (c.head_dim + 4)
        assert decode_bytes(model, int8, context) - decode_bytes(model, int8, 0) == read * int8_position


def test_packed_weights_count_codes_and_scales(folders):
    model = load_model(folders["rtn"])
    q = model.model.layers[0].self_attn.q_proj
    N, K = q.out_features, q.in_features
    assert weight_bytes(q.weight) == N * K // 2 + N * (K // 32) * 2  # 4-bit codes + fp16 scale per group


def test_flops_count_linears_lm_head_and_windowed_attention(folders):
    model = load_model(folders["ref"])
    c = model.config
    block_params = sum(m.in_features * m.out_features for m in model.model.layers.modules() if isinstance(m, QLinear))
    head = c.hidden_size * c.vocab_size

    def attention(queries):  # brute force: visible (query, key) pairs per layer
        total = 0
        for window in c.sliding_window:
            for q in queries:
                total += sum(1 for k in range(q + 1) if window is None or q - k < window)
        return 4 * c.num_heads * c.head_dim * total

    T = 23
    assert prefill_flops(model, T) == 2 * block_params * T + 2 * head + attention(range(T))
    assert decode_flops(model, 40) == 2 * block_params + 2 * head + attention([40])


def test_effective_bits_and_size(folders):
    assert effective_bits(folders["ref"]) == 16.0
    assert effective_bits(folders["rtn"]) == 4.5  # 4 bits + one fp16 scale per 32 weights
    model = load_model(folders["fp8"])
    shapes = [(m.out_features, m.in_features) for m in model.model.layers.modules() if isinstance(m, QLinear)]
    # fp8 codes + one fp32 scale per output channel
    expected = sum(8 * N * K + 32 * N for N, K in shapes) / sum(N * K for N, K in shapes)
    assert effective_bits(folders["fp8"]) == pytest.approx(expected, rel=1e-12)
    head = model.config.vocab_size * model.config.hidden_size
    blocks = sum(N * K for N, K in shapes)
    assert effective_bits(folders["rtn_head"]) == pytest.approx((4.5 * blocks + 8.5 * head) / (blocks + head), rel=1e-12)
    assert size_on_disk(folders["ref"]) == (folders["ref"] / "model.safetensors").stat().st_size
    assert size_on_disk(folders["rtn"]) < size_on_disk(folders["ref"])


def test_content_key_is_stable_and_follows_the_weights(folders, tmp_path):
    assert content_key(folders["ref"]) == content_key(folders["ref"])
    assert content_key(folders["ref"]) != content_key(folders["rtn"])
    copy = shutil.copytree(folders["ref"], tmp_path / "copy")
    before = content_key(copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: same bytes, new mtime
    assert content_key(copy) != before
    # rewritten in place and given back its old mtime (touch -r, or a copy that keeps times): the ctime still moves
    stat, before = weights.stat(), content_key(copy)
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert content_key(copy) != before
    # what qinfer eval writes into the folder (--out may be it) is not the model
    before = content_key(copy)
    for name in REPORT_FILES:
        (copy / name).write_text("x")
    assert content_key(copy) == before
    (copy / "notes.txt").write_text("x")
    assert content_key(copy) != before


@pytest.mark.parametrize("native_bf16", [True, False])
def test_prefill_flops_split_by_the_dtype_each_kernel_multiplies_in(folders, monkeypatch, native_bf16):
    # A dense product of the prompt's rows (a bf16 model's linears; FP8's: dequantize, then the dense product)
    # multiplies in bf16 on a CPU with native bf16 GEMMs, else in fp32; a 4-bit model's block linears go
    # through the CPU int4 kernel, which multiplies in fp32, for a prompt shorter than its max_rows, and to
    # the dequantize-then-dense path from there on. The attention goes with a dense product of the prompt's
    # rows; the lm_head's one row stays bf16. The split always sums to prefill_flops.
    monkeypatch.setattr(dense, "native_half_gemm", lambda dtype: native_bf16 or dtype == torch.float32)
    dense_dtype = torch.bfloat16 if native_bf16 else torch.float32

    def split(model, T, blocks_in):
        linears = [m for m in model.model.layers.modules() if isinstance(m, QLinear)]
        blocks = 2 * T * sum(m.in_features * m.out_features for m in linears)
        head = 2 * model.lm_head.in_features * model.lm_head.out_features
        expected = Counter({torch.bfloat16: head})
        expected[dense_dtype] += prefill_flops(model, T) - blocks - head  # the attention
        expected[blocks_in] += blocks
        return dict(expected)

    # such a CPU (AVX2 only) has no AVX512-BF16 loop for a few bf16 rows either
    with contextlib.nullcontext() if native_bf16 else cpu_library.bf16_without_dot():
        T = 23
        for name in ("ref", "fp8"):
            model = load_model(folders[name])
            assert prefill_flops_by_dtype(model, T) == split(model, T, dense_dtype)
        model = load_model(folders["rtn"])
        linears = [m for m in model.model.layers.modules() if isinstance(m, QLinear)]
        assert all(int4_cpu.supported(torch.empty(T, m.in_features, dtype=model.dtype), m.weight) for m in linears)
        assert prefill_flops_by_dtype(model, T) == split(model, T, torch.float32)
        long = int4_cpu.max_rows(model.dtype)
        assert prefill_flops_by_dtype(model, long) == split(model, long, dense_dtype)
