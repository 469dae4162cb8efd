import math
import weakref

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.evals.divergence import batch_means_se, se_block, text_metrics
from qinfer.evals.forward import window_logits
from qinfer.evals.perplexity import perplexity, windows
from qinfer.model.loader import load_model
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
    """KL, agreement and nll in float64, one position at a time, and the per-token nll differences and KLs."""
    kl = agree = nll = 0.0
    n = 0
    deltas, kls = [], []
    for start, end, first in windows(tokens.numel(), window, stride):
        ids = tokens[start : end - 1]
        lp = torch.log_softmax(p_fn(ids, first - 1 - start).double(), -1)
        lq = torch.log_softmax(q_fn(ids, first - 1 - start).double(), -1)
        for i, target in enumerate(tokens[first:end]):
            kls.append(float((lp[i].exp() * (lp[i] - lq[i])).sum()))
            kl += kls[-1]
            agree += float(lp[i].argmax() == lq[i].argmax())
            nll -= float(lq[i, target])
            deltas.append(float(lp[i, target] - lq[i, target]))
            n += 1
    return kl / n, agree / n, nll / n, n, torch.tensor(deltas), torch.tensor(kls)


def test_kl_agreement_and_perplexity_are_exact():
    tokens = torch.randint(0, V, (150,), generator=torch.Generator().manual_seed(1))
    base, other = _positional(0), _positional(1)
    got = text_metrics(base, {"other": other}, tokens, window=40, stride=16, chunk=7, progress=False,
                       block=16)["other"]
    kl, agree, nll, n, deltas, kls = _brute_force(tokens, 40, 16, base, other)
    assert got.tokens == n == 149
    assert got.kl == pytest.approx(kl, rel=1e-5) and got.kl > 0.1
    assert got.top1_agreement == agree
    assert got.nll == pytest.approx(nll, rel=1e-6) and got.ppl == pytest.approx(math.exp(nll), rel=1e-6)
    assert (got.window, got.stride) == (40, 16)
    # the ratio to the baseline's perplexity and the standard errors come from the per-token series, in text order
    base_nll = text_metrics(base, {"base": base}, tokens, window=40, stride=16, progress=False)["base"].nll
    assert got.nll_delta == pytest.approx(float(deltas.mean()), rel=1e-5)
    assert got.ppl_ratio == pytest.approx(math.exp(nll - base_nll), rel=1e-5)
    assert got.nll_delta_se == pytest.approx(batch_means_se(deltas, 16), rel=1e-4) and got.nll_delta_se > 0
    assert got.kl_se == pytest.approx(batch_means_se(kls, 16), rel=1e-4) and got.kl_se > 0


def test_the_baseline_against_itself_is_zero_kl_and_full_agreement():
    tokens = torch.randint(0, V, (90,), generator=torch.Generator().manual_seed(2))
    base = _positional(0)
    twin = _positional(0)  # the same function, computed separately
    got = text_metrics(base, {"self": base, "twin": twin}, tokens, window=32, stride=8, progress=False, block=8)
    for name in ("self", "twin"):
        assert got[name].kl == 0.0 and got[name].top1_agreement == 1.0
        assert got[name].nll_delta == 0.0 and got[name].nll_delta_se == 0.0 and got[name].kl_se == 0.0
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


def test_each_models_window_logits_are_let_go_before_the_next_models_forward():
    tokens = torch.randint(0, V, (120,), generator=torch.Generator().manual_seed(4))
    alive, calls = [], []  # weak references to the logits each model returned; (model, how many still alive)

    def tracked(name, fn):
        def logits(ids, first):
            calls.append((name, sum(ref() is not None for ref in alive)))
            out = fn(ids, first).clone()
            alive.append(weakref.ref(out))
            return out
        return logits

    base = tracked("base", _positional(0))
    models = {name: tracked(name, _positional(seed)) for seed, name in enumerate("abc", start=1)}
    got = text_metrics(base, models, tokens, window=40, stride=16, progress=False)
    per_window = len(list(windows(tokens.numel(), 40, 16)))
    # in each window: the baseline's forward, then a, b, c in turn, each seeing only the baseline's logits alive
    assert [name for name, _ in calls] == ["base", "a", "b", "c"] * per_window
    assert [held for name, held in calls if name != "base"] == [1] * (3 * per_window)
    assert all(held <= 1 for _, held in calls)  # never more than one window's logits held at any forward
    for name, seed in zip("abc", range(1, 4)):  # the same figures as each model measured alone
        alone = text_metrics(_positional(0), {name: _positional(seed)}, tokens, window=40, stride=16,
                             progress=False)[name]
        assert got[name] == alone


def test_no_models_is_an_error():
    with pytest.raises(QinferError, match="no models"):
        text_metrics(_positional(0), {}, torch.zeros(10, dtype=torch.long), 4, 2, progress=False)


def test_batch_means_standard_error_by_hand():
    # blocks of 2, the remainder joining the last: means 1.5, 3.5, 6; overall mean 4
    values = torch.tensor([1.0, 2, 3, 4, 5, 6, 7])
    expected = math.sqrt(((1.5 - 4) ** 2 + (3.5 - 4) ** 2 + (6 - 4) ** 2) / (3 * 2))
    assert batch_means_se(values, block=2) == pytest.approx(expected, rel=1e-12)
    assert batch_means_se(values, block=4) is None  # one block: no spread to estimate from
    assert batch_means_se(torch.full((300,), 2.5), block=10) == 0.0


def test_batch_means_standard_error_follows_the_correlation():
    # independent values: close to sd / sqrt(n); AR(1) values with coefficient phi: a per-token standard error
    # understates the true sqrt((1 + phi) / (1 - phi)) sd / sqrt(n) by that factor, and the batch means do not
    n, phi = 40000, 0.8
    noise = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    iid_se = batch_means_se(noise, block=128)
    assert iid_se == pytest.approx(1 / math.sqrt(n), rel=0.2)
    ar = torch.empty(n, dtype=torch.float64)
    ar[0] = noise[0]
    for t in range(1, n):
        ar[t] = phi * ar[t - 1] + math.sqrt(1 - phi**2) * noise[t]  # unit variance
    true_se = math.sqrt((1 + phi) / (1 - phi)) / math.sqrt(n)
    assert batch_means_se(ar, block=128) == pytest.approx(true_se, rel=0.25)
    assert float(ar.std()) / math.sqrt(n) < 0.5 * true_se  # what ignoring the correlation would report


def test_the_blocks_grow_with_the_text_past_sixteen_of_the_shortest():
    assert [se_block(n) for n in (100, 2047, 2048, 8191, 32767)] == [128, 128, 128, 511, 2047]


def test_a_loss_past_float64s_exp_is_an_infinite_perplexity():
    # a broken model (finite weights, huge logits): mean loss over 709 nats is ppl inf, not an OverflowError
    tokens = torch.randint(0, V, (200,), generator=torch.Generator().manual_seed(3))
    base = _positional(0)
    broken = _positional(1, scale=1e4)
    got = text_metrics(base, {"broken": broken}, tokens, window=40, stride=16, progress=False)["broken"]
    assert got.nll > 710 and got.ppl == math.inf and got.ppl_change == math.inf
    assert perplexity(lambda ids: broken(ids[0], 0)[None], tokens, window=40, stride=16, progress=False).ppl == math.inf
