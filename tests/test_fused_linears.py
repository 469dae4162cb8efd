"""Linears that read one input, fused for a model that runs: the same numbers, no second copy of a weight."""

import contextlib

import pytest
import torch

from qinfer.format import Fp8Weight, QuantizedWeight, QuantScheme, group_count, pack
from qinfer.engine.generate import decode_step, prefill
from qinfer.kernels import gemv_cpu
from qinfer.kernels.linear import linear
from qinfer.model.kv_cache import make_cache
from qinfer.model.loader import huge_pages_reason, load_model
from qinfer.model.decoder import FusedLinear, QLinear, fuse_linears, separate_linears, stacked
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from tests.tiny_models import make_model


def _int_weight(N, K, bits, group_size, symmetric, perm, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.uint8)
    groups = group_count(K, group_size)
    scale = (torch.rand(N, groups, generator=g) + 0.01).half()
    zero = None if symmetric else torch.randint(0, 1 << bits, (N, groups), generator=g, dtype=torch.uint8)
    return QuantizedWeight(pack(codes, bits), scale, zero, bits, group_size, (N, K), perm)


def _fp8_weight(N, K, per_tensor, seed):
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(N, K, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(1 if per_tensor else N, *(() if per_tensor else (1,)), generator=g) + 0.01
    return Fp8Weight(codes, scale)


def _dense(w) -> torch.Tensor:
    return w.float() if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _codes(w) -> torch.Tensor:
    """A weight's largest tensor: dense values, FP8 codes or packed integer codes."""
    return w if isinstance(w, torch.Tensor) else (w.weight if isinstance(w, Fp8Weight) else w.qweight)


PERM = torch.randperm(64, generator=torch.Generator().manual_seed(1)).to(torch.int32)
CASES = {
    "bf16": lambda n, s: torch.randn(n, 64, generator=torch.Generator().manual_seed(s)).bfloat16(),
    "int4 asym": lambda n, s: _int_weight(n, 64, 4, 32, False, None, s),
    "int4 sym, permuted": lambda n, s: _int_weight(n, 64, 4, 32, True, PERM, s),
    "int3": lambda n, s: _int_weight(n, 64, 3, 32, False, None, s),
    "int2 per channel": lambda n, s: _int_weight(n, 64, 2, -1, False, None, s),
    "int8": lambda n, s: _int_weight(n, 64, 8, 64, True, None, s),
    "fp8 per channel": lambda n, s: _fp8_weight(n, 64, False, s),
    "fp8 per tensor": lambda n, s: _fp8_weight(n, 64, True, s),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stacked_weight_is_the_members_side_by_side_and_they_are_views_of_it(case):
    members = [CASES[case](n, seed) for seed, n in enumerate((48, 16, 16))]
    whole, views = stacked(members)
    assert type(whole) is type(members[0]) and tuple(whole.shape) == (80, 64)
    assert torch.equal(_dense(whole), torch.cat([_dense(m) for m in members]))
    for view, member in zip(views, members):
        assert torch.equal(_dense(view), _dense(member))
    # each view's codes are rows of the stacked weight's: one storage, nothing stored twice
    assert all(_storage(_codes(v)) == _storage(_codes(whole)) for v in views)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    y = linear(x, whole)
    assert torch.equal(y, torch.cat([linear(x, v) for v in views], dim=-1))  # one row: each output its own sum


def test_weights_that_do_not_stack():
    w4 = lambda **kw: _int_weight(**{"N": 16, "K": 64, "bits": 4, "group_size": 32, "symmetric": False,  # noqa: E731
                                     "perm": None, "seed": 0, **kw})
    assert stacked([w4(), w4(bits=3)]) is None
    assert stacked([w4(), w4(group_size=64)]) is None
    assert stacked([w4(), w4(symmetric=True)]) is None
    assert stacked([w4(perm=PERM), w4()]) is None
    assert stacked([w4(perm=PERM), w4(perm=PERM.flip(0))]) is None
    assert stacked([w4(), w4(K=32)]) is None
    assert stacked([w4(), _fp8_weight(16, 64, False, 0)]) is None
    assert stacked([torch.zeros(4, 64), torch.zeros(4, 64, dtype=torch.bfloat16)]) is None
    assert stacked([w4(perm=PERM), w4(perm=PERM.clone())]) is not None  # equal permutations do


SCHEMES = {
    "dense": None,
    "rtn int4": QuantScheme(method="rtn", bits=4, group_size=32, symmetric=False),
    "rtn int3 sym": QuantScheme(method="rtn", bits=3, group_size=32, symmetric=True),
    "fp8 per tensor": QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1, fp8_granularity="tensor"),
}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_fused_model_decodes_bit_for_bit_as_the_separate_one(tmp_path, kind, scheme):
    folder = tmp_path / "src"
    make_model(kind, folder)  # qwen2: q/k/v with biases
    if SCHEMES[scheme] is not None:
        quantize_model(folder, tmp_path / "q", SCHEMES[scheme], CalibConfig(samples=2, seq_len=16))
        folder = tmp_path / "q"
    plain, model = load_model(folder), load_model(folder, run=True)
    layers = model.model.layers
    assert all(isinstance(b.self_attn.fused, FusedLinear) and isinstance(b.mlp.fused, FusedLinear) for b in layers)
    assert all(b.self_attn.fused is None and b.mlp.fused is None for b in plain.model.layers)
    assert fuse_linears(model) == 0  # fused once
    # the state dict and the walks over linears see the members only
    assert set(model.state_dict()) == set(plain.state_dict())
    assert sum(isinstance(m, QLinear) for m in model.modules()) == sum(isinstance(m, QLinear) for m in plain.modules())
    ids = torch.tensor([[1, 7, 7, 300, 5, 42]])
    steps = {}
    for name, net, context in (("plain", plain, contextlib.nullcontext), ("fused", model, contextlib.nullcontext),
                               ("separate", model, separate_linears)):
        cache = make_cache(net, 1, 16, "bf16")
        with torch.no_grad(), context():
            token = prefill(net, ids, cache).argmax(-1)
            steps[name] = [decode_step(net, token, ids.shape[1] + i, cache) for i in range(4)]
    for a, b, c in zip(steps["plain"], steps["fused"], steps["separate"]):
        assert torch.equal(a, b) and torch.equal(a, c)
    if not huge_pages_reason():  # moved into one map, the members are still views of their fused weight
        attn = layers[0].self_attn
        q, whole = _codes(attn.q_proj.weight), _codes(attn.fused.weight)
        assert q.data_ptr() == whole.data_ptr() and _storage(q) == _storage(whole)


def test_a_member_given_a_new_weight_runs_on_its_own(tmp_path):
    make_model("llama", tmp_path)
    plain, model = load_model(tmp_path), load_model(tmp_path, run=True)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    rows = gemv_cpu.bf16_rows_max() if gemv_cpu.cpu_library.available() else 1  # rows the C GEMV sums alone
    assert attn.fused.runs(x) and attn.fused.runs(x.expand(1, rows, 64)) and not attn.fused.runs(
        x.expand(1, rows + 1, 64))
    with separate_linears():
        assert not attn.fused.runs(x)
    new = torch.randn_like(attn.k_proj.weight)
    for net in (plain, model):
        net.model.layers[0].self_attn.k_proj.weight = torch.nn.Parameter(new.clone(), requires_grad=False)
    assert not attn.fused.runs(x)
    ids = torch.tensor([[1, 7, 7, 300]])
    out = []
    for net in (plain, model):  # the fused weights still hold the old keys' rows: used, they would differ
        cache = make_cache(net, 1, 8, "bf16")
        with torch.no_grad():
            token = prefill(net, ids, cache).argmax(-1)
            out.append(decode_step(net, token, ids.shape[1], cache))
    assert torch.equal(out[0], out[1])
