import math

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.evals.divergence import text_metrics
from qinfer.evals.forward import window_logits
from qinfer.evals.perplexity import perplexity, windows
from qinfer.loader import load_model
from tests.evals.eval_fixtures import tiny_model

V = 37


def _positional(seed: int, scale: float = 3.0):
    """A LogitsFn whose logits depend on (token, position in window) through a fixed random table."""
    table = torch.randn(V, 64, V, generator=torch.Generator().manual_seed(seed)) * scale

    def logits(ids, first):
        pos = torch.arange(ids.numel())
        return table[ids, pos][first:]

    return logits


def _brute_force(tokens, window, stride, p_fn, q_fn):
    """KL, agreement and nll in float64, one position at a time."""
    kl = agree = nll = 0.0
    n = 0
    for start, end, first in windows(tokens.numel(), window, stride):
        ids = tokens[start : end - 1]
        lp = torch.log_softmax(p_fn(ids, first - 1 - start).double(), -1)
        lq = torch.log_softmax(q_fn(ids, first - 1 - start).double(), -1)
        for i, target in enumerate(tokens[first:end]):
            kl += float((lp[i].exp() * (lp[i] - lq[i])).sum())
            agree += float(lp[i].argmax() == lq[i].argmax())
            nll -= float(lq[i, target])
            n += 1
    return kl / n, agree / n, nll / n, n


def test_kl_agreement_and_perplexity_are_exact():
    tokens = torch.randint(0, V, (150,), generator=torch.Generator().manual_seed(1))
    base, other = _positional(0), _positional(1)
    got = text_metrics(base, {"other": other}, tokens, window=40, stride=16, chunk=7, progress=False)["other"]
    kl, agree, nll, n = _brute_force(tokens, 40, 16, base, other)
    assert got.tokens == n == 149
    assert got.kl == pytest.approx(kl, rel=1e-5) and got.kl > 0.1
    assert got.top1_agreement == agree
    assert got.nll == pytest.approx(nll, rel=1e-6) and got.ppl == pytest.approx(math.exp(nll), rel=1e-6)
    assert (got.window, got.stride) == (40, 16)


def test_the_baseline_against_itself_is_zero_kl_and_full_agreement():
    tokens = torch.randint(0, V, (90,), generator=torch.Generator().manual_seed(2))
    base = _positional(0)
    twin = _positional(0)  # the same function, computed separately
    got = text_metrics(base, {"self": base, "twin": twin}, tokens, window=32, stride=8, progress=False)
    for name in ("self", "twin"):
        assert got[name].kl == 0.0 and got[name].top1_agreement == 1.0
    assert got["self"].ppl == got["twin"].ppl


def test_perplexity_matches_the_sliding_window_perplexity(tmp_path):
    model = load_model(tiny_model(tmp_path / "m"), dtype=torch.float32)
    tokens = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(3))
    fn = window_logits(model, "bf16", bos_id=0)
    got = text_metrics(fn, {"m": fn}, tokens, window=64, stride=24, progress=False)["m"]

    def forward(ids):  # full logits, with the same BOS in front
        return model(torch.cat([torch.tensor([[0]]), ids], dim=1))[:, 1:]

    ref = perplexity(forward, tokens, window=64, stride=24, progress=False)
    assert got.tokens == ref.tokens
    assert got.ppl == pytest.approx(ref.ppl, rel=1e-5)


def test_no_models_is_an_error():
    with pytest.raises(QinferError, match="no models"):
        text_metrics(_positional(0), {}, torch.zeros(10, dtype=torch.long), 4, 2, progress=False)
