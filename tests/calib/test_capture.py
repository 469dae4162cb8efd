"""Block capture: a partial capture records exactly what a full one does for its groups, and stops early."""

import os

import pytest
import torch

from qinfer.calib import capture
from qinfer.calib.capture import calibrate_in_stages, capture_block, embed_samples, run_block
from qinfer.model.loader import load_model
from tests.tiny_models import make_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_model(request.param, folder)
    return load_model(folder, dtype=torch.float32)


@pytest.mark.parametrize("group", [("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj")])
def test_partial_capture_matches_full_and_stops_early(tiny_model, group):
    model = tiny_model
    groups = tuple(g.linears for g in model.config.arch.linear_groups)
    X = embed_samples(model, torch.randint(0, 300, (10, 16)), torch.float32)
    full = capture_block(model, 1, X, groups)
    calls = []
    down = model.model.layers[1].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    try:
        part = capture_block(model, 1, X, (group,), partial=True)
    finally:
        handle.remove()
    assert calls == []  # the block stopped before its last linear
    for name in group:
        torch.testing.assert_close(part.linears[name].H, full.linears[name].H)
        torch.testing.assert_close(part.linears[name].abs_sum, full.linears[name].abs_sum)
        assert part.linears[name].n == full.linears[name].n == 10 * 16
    assert set(part.linears) == set(group)


def test_batching_does_not_change_the_statistics(tiny_model, monkeypatch):
    """Batches of 3 samples (the last one short) give what one batch of all 10 does (also in place); H comes
    out symmetric."""
    model = tiny_model
    groups = tuple(g.linears for g in model.config.arch.linear_groups)
    X = embed_samples(model, torch.randint(0, 300, (10, 16)), torch.float32)
    one = capture_block(model, 1, X, groups)
    out_one = run_block(model, 1, X)
    c = model.config
    width = max(c.intermediate_size, c.hidden_size, c.num_heads * c.head_dim)
    monkeypatch.setattr(capture, "BATCH_BYTES", 3 * 16 * width * 4)
    assert capture.batch_size(model, X) == 3
    three = capture_block(model, 1, X, groups)
    torch.testing.assert_close(run_block(model, 1, X), out_one)
    X_in = X.clone()
    torch.testing.assert_close(run_block(model, 1, X_in, out=X_in), out_one)  # in place, batch by batch
    torch.testing.assert_close(X_in, out_one)
    for name, s in three.linears.items():
        torch.testing.assert_close(s.H, one.linears[name].H, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(s.H, s.H.T)
        x = torch.randn(s.H.shape[0], 2, dtype=torch.float64)
        assert float((x.T @ s.H.double() @ x).diagonal().min()) >= 0  # a Gram matrix: positive semi-definite
        assert s.n == one.linears[name].n == 10 * 16
    torch.testing.assert_close(three.k_absmax, one.k_absmax)


def test_upper_gram_is_the_full_product():
    x = torch.randn(50, 600, generator=torch.Generator().manual_seed(0))  # 600: three strips, the last short
    H = torch.zeros(600, 600)
    capture._add_upper_gram(H, x)
    capture._add_upper_gram(H, 2 * x)
    torch.testing.assert_close(capture._symmetric(H), 5 * x.T @ x, rtol=1e-5, atol=1e-3)
    xb = x.bfloat16()  # bf16 activations (calibration on CPUs with fast bf16): bf16 products, fp32 sums
    Hb = torch.zeros(600, 600)
    capture._add_upper_gram(Hb, xb)
    assert Hb.dtype == torch.float32
    exact = xb.float().T @ xb.float()
    torch.testing.assert_close(capture._symmetric(Hb), exact, rtol=1e-2, atol=0.1)


def test_reuse_freed_memory_is_accepted_by_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc tuning applies to glibc only")
    assert capture.reuse_freed_memory() is True  # mallopt returned success for both settings


def test_return_freed_memory_gives_back_the_heaps_holes():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")

    def rss_mib() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    capture.reuse_freed_memory()  # freed blocks stay with malloc: the holes below stay resident
    blocks = [torch.ones(1 << 18) for _ in range(400)]  # 1 MiB each, from the heap
    blocks = blocks[1::2]  # free every other one: 200 MiB of holes no trim of the heap's top reaches
    before = rss_mib()
    assert capture.return_freed_memory() is True
    assert before - rss_mib() > 100
    assert all(float(b[-1]) == 1.0 for b in blocks)  # the live ones are untouched


@pytest.mark.parametrize("keep", [torch.float32, torch.bfloat16])
def test_staged_pass_matches_a_capture_per_group(tiny_model, monkeypatch, keep):
    """calibrate_in_stages gives each group the statistics a fresh capture would, taken after the groups
    before it changed, with the reference stream's shifts; X and X_ref end as the blocks' outputs."""
    model = tiny_model
    monkeypatch.setattr(capture, "KEEP_DTYPE", keep)
    c = model.config
    width = max(c.intermediate_size, c.hidden_size, c.num_heads * c.head_dim)
    monkeypatch.setattr(capture, "BATCH_BYTES", 3 * 16 * width * 4)  # batches of 3, the last one short
    block = model.model.layers[1]
    groups = tuple(g.linears for g in model.config.arch.linear_groups)
    own = {name: block.get_submodule(name).weight.data for group in groups for name in group}
    X0 = embed_samples(model, torch.randint(0, 300, (10, 16)), torch.float32)
    X_ref0 = X0 + 0.1 * torch.randn(X0.shape, generator=torch.Generator().manual_seed(0))
    X, X_ref = X0.clone(), X_ref0.clone()
    seen, expected = [], {}

    def quantize(g, stats):  # group g's inputs on both streams now, then "quantize" the group
        seen.append(g)
        x = _inputs(model, 1, X0, groups[g][0])  # with the groups before it changed
        changed = {name: block.get_submodule(name).weight.data for name in own}
        try:
            for name, w in own.items():
                block.get_submodule(name).weight.data = w
            x_ref = _inputs(model, 1, X_ref0, groups[g][0])
        finally:
            for name, w in changed.items():
                block.get_submodule(name).weight.data = w
        expected[g] = (x.T @ x, x.abs().sum(0), (x_ref - x).T @ x, x.shape[0])
        for name in groups[g]:
            block.get_submodule(name).weight.data = own[name] * 0.9 + 0.01
    try:
        staged = calibrate_in_stages(model, 1, X, quantize, X_ref, own)
        changed_out = run_block(model, 1, X0)
        changed_kv = capture_block(model, 1, X0, ())
    finally:
        for name, w in own.items():
            block.get_submodule(name).weight.data = w
    assert seen == [0, 1, 2, 3]
    for g, group in enumerate(groups):
        H, abs_sum, D, n = expected[g]
        # the first two groups' inputs come before anything kept (and maybe rounded to bf16) is read back
        tol = 1e-5 if g < 2 or keep == torch.float32 else 1e-2
        for name in group:
            got = staged.linears[name]
            assert got.n == n == 10 * 16
            assert _rel(got.H, H) < tol and _rel(got.abs_sum, abs_sum) < tol
            assert _rel(got.D, D) < 10 * tol  # a difference of nearby activations
    assert _rel(X, changed_out) < (1e-5 if keep == torch.float32 else 1e-2)
    torch.testing.assert_close(X_ref, run_block(model, 1, X_ref0))  # the reference ran on the own weights
    torch.testing.assert_close(staged.k_absmax, changed_kv.k_absmax)  # with the quantized q/k/v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_shift_is_summed_in_fp32_from_products_in_the_activations_dtype(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 48, generator=g).to(dtype)
    x_ref = (x.float() + 0.05 * torch.randn(300, 48, generator=g)).to(dtype)
    s = capture._new_stats(48, True)
    for _ in range(2):
        capture._add_shift(s, x_ref, x)
    exact = 2 * (x_ref.double() - x.double()).T @ x.double()
    assert s.D.dtype == torch.float32
    assert _rel(s.D.double(), exact) < tol  # bf16: the difference and each batch's product rounded to bf16
    if dtype == torch.bfloat16:
        assert _rel(s.D.double(), exact) > 1e-6  # (and it did run in bf16)


def test_staged_pass_without_a_reference_is_the_block_forward(tiny_model):
    model = tiny_model
    groups = tuple(g.linears for g in model.config.arch.linear_groups)
    X = embed_samples(model, torch.randint(0, 300, (10, 16)), torch.float32)
    full = capture_block(model, 1, X, groups)
    out = run_block(model, 1, X)
    staged = calibrate_in_stages(model, 1, X, lambda g, stats: None)  # nothing changes: one plain forward
    assert _rel(X, out) < 1e-2  # the kept inputs were rounded to bf16
    for name, s in staged.linears.items():
        assert _rel(s.H, full.linears[name].H) < 1e-2
        assert s.D is None
    torch.testing.assert_close(staged.k_absmax, full.k_absmax)


def _inputs(model, layer_idx, X, name) -> torch.Tensor:
    """[S * L, K]: what linear ``name`` of block ``layer_idx`` reads on X, one forward with a hook."""
    seen = []
    module = model.model.layers[layer_idx].get_submodule(name)
    handle = module.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0].reshape(-1, inputs[0].shape[-1])))
    try:
        run_block(model, layer_idx, X)
    finally:
        handle.remove()
    return torch.cat(seen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_a_stored_bos_position_is_left_out_of_the_statistics(tiny_model):
    """With a stored BOS position the blocks attend to its keys and values, and no statistic but the K/V
    ranges counts position 0: what the quantized weights compute there is never used."""
    model = tiny_model
    groups = tuple(g.linears for g in model.config.arch.linear_groups)
    ids = torch.randint(2, 300, (6, 16))
    ids[:, 0] = model.config.bos_token_id
    X = embed_samples(model, ids, torch.float32)
    X[:, 0] = torch.randn(X.shape[-1], generator=torch.Generator().manual_seed(0))  # (Gemma's BOS embedding is zero)
    bos = model.own_bos()
    bos.kv[1] = (bos.kv[1][0] + 1.0, bos.kv[1][1] - 1.0)  # not what block 1 computes: its use shows
    model.set_bos(bos)
    try:
        inputs = {g[0]: _inputs(model, 1, X, g[0]).reshape(6, 16, -1) for g in groups}  # with the stored K/V
        full = capture_block(model, 1, X, groups)
        staged = calibrate_in_stages(model, 1, X.clone(), lambda g, stats: None)
    finally:
        model.set_bos(None)
    plain = _inputs(model, 1, X, "self_attn.o_proj").reshape(6, 16, -1)
    assert _rel(inputs["self_attn.o_proj"], plain) > 1e-3  # the attention read the stored K/V
    for name, x in inputs.items():
        x = x[:, 1:].reshape(-1, x.shape[-1])
        for stats in (full, staged):
            s = stats.linears[name]
            assert s.n == 6 * 15
            assert _rel(s.H, x.T @ x) < 1e-2 and _rel(s.abs_sum, x.abs().sum(0)) < 1e-2
