"""Block capture: a partial capture records exactly what a full one does for its groups, and stops early."""

import pytest
import torch

from qinfer.calib.capture import capture_block, embed_samples
from qinfer.loader import load_model
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
    X = embed_samples(model, torch.randint(0, 300, (10, 16)), torch.float32)  # 10 samples: two batches of 8
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
