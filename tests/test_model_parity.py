"""Our decoder against transformers on tiny random models of every supported architecture."""

import pytest
import torch

from qinfer.kv_cache import KVCache
from qinfer.loader import load_model
from tests.tiny_models import CONFIGS, make_model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_match_transformers(kind, tmp_path):
    ref = make_model(kind, tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_cached_decode_matches_full_forward(kind, tmp_path):
    make_model(kind, tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, batch=1, max_len=32, dtype=torch.float32)
        steps = [model(ids[:, :9], torch.arange(9), cache)]
        for t in range(9, 16):
            steps.append(model(ids[:, t : t + 1], torch.tensor([t]), cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)
