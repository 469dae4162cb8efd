"""How far a model's comparison with the reference moves with the text: a check on ``qinfer eval``'s ``±``.

``qinfer eval`` gives each model's perplexity change against the baseline and its KL with a standard error by
batch means (:mod:`qinfer.evals.divergence`: :data:`~qinfer.evals.divergence.SE_BLOCKS` blocks of at least
:data:`~qinfer.evals.divergence.SE_MIN_BLOCK` tokens). That is only right if blocks of that length are nearly
independent. This scores the models once over a long text and prints, per model::

    python -m qinfer.evals.diagnostics.text_spread gemma3-270m QUANTIZED [QUANTIZED ...] [--max-tokens 32768] [--segment 2048]

- the whole text's change and KL with their standard errors for several block lengths, ``qinfer eval``'s
  marked: where the errors stop growing with the block, the blocks are long enough; and
- the text cut into segments as long as an eval's text (``--segment`` tokens, as ``--max-tokens`` would read;
  the tail that does not fill one is left out): each segment's change, their standard deviation (what the
  result of a ``--max-tokens SEGMENT`` eval moves by with the passage it happens to read), and the median
  of the standard errors ``qinfer eval`` would report for a segment, which match that deviation if the ``±``
  is honest.

Diagnostic only: nothing is written, nothing cached.
"""

import statistics

import click
import torch

from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.evals.accuracy import HELDOUT
from qinfer.evals.checkpoint import check_quantized
from qinfer.evals.divergence import TokenSeries, se_block, token_series
from qinfer.evals.forward import window_logits
from qinfer.evals.runner import EvalConfig, comparison
from qinfer.model.loader import load_model

BLOCKS = (1, 32, 128, 512, 2048)  # besides qinfer eval's own


@click.command(cls=Command)
@click.argument("model")
@click.argument("quantized", nargs=-1, required=True)
@click.option("--text", default=HELDOUT, show_default=True, help="'heldout' or a UTF-8 text file, as for qinfer eval.")
@click.option("--max-tokens", type=int, default=32768, show_default=True)
@click.option("--segment", type=int, default=2048, show_default=True, help="Tokens per segment (an eval's --max-tokens).")
@click.option("--window", type=int, default=512, show_default=True)
@click.option("--stride", type=int, default=256, show_default=True)
def main(model, quantized, text, max_tokens, segment, window, stride):
    _report(model, quantized, text, max_tokens, segment, window, stride)


@torch.no_grad()
def _report(model, quantized, text, max_tokens, segment, window, stride):
    # the checks qinfer eval makes (window, stride, context, vocabulary, tokenization), before any model is loaded
    config = EvalConfig(models=quantized, baseline=model, text=text, max_tokens=max_tokens, window=window,
                        stride=stride, tasks=(), speed=False, out=None)
    if segment < window:
        raise QinferError(f"--segment ({segment}) must be at least one --window ({window})")
    models, baseline, tokens, _ = comparison(config)
    for m in models:
        check_quantized(m.folder, m.spec)
    if tokens.numel() < 2 * segment:
        raise QinferError(f"the text has {tokens.numel()} tokens, fewer than two --segment of {segment}")
    base = window_logits(load_model(baseline.folder), "bf16", baseline.tokenizer.leading_bos)
    fns = {m.label: window_logits(load_model(m.folder), "bf16", m.tokenizer.leading_bos) for m in models}
    series = token_series(base, fns, tokens, window, stride)
    for label, s in series.items():
        _print_model(label, s, segment, window, stride)


def _print_model(label: str, s: TokenSeries, segment: int, window: int, stride: int) -> None:
    n = s.nll.numel()
    whole = s.metrics(window, stride)  # exactly what qinfer eval reports for this text
    click.echo(f"{label}: {n} scored tokens, perplexity {whole.ppl_change:+.3f}% against the reference, "
               f"KL {whole.kl:.4f}")
    for block in sorted({*BLOCKS, se_block(n)}):
        m = s.metrics(window, stride, block)
        if m.ppl_change_se is not None:
            click.echo(f"  standard errors with blocks of {block:5d} tokens ({n // block} blocks): "
                       f"±{m.ppl_change_se:.2f} points, KL ±{m.kl_se:.4f}"
                       + (" (qinfer eval's)" if block == se_block(n) else ""))
    per = segment - 1  # a --max-tokens SEGMENT text scores all its tokens but the first
    cuts = [s[i * per:(i + 1) * per].metrics(window, stride) for i in range(n // per)]  # what eval reports for each
    own = [m.ppl_change_se for m in cuts if m.ppl_change_se is not None]
    own_kl = [m.kl_se for m in cuts if m.kl_se is not None]
    click.echo(f"  {len(cuts)} segments of {segment} tokens: " + ", ".join(f"{m.ppl_change:+.1f}%" for m in cuts))
    click.echo(f"    standard deviation across them {statistics.stdev(m.ppl_change for m in cuts):.2f} points, KL "
               f"{statistics.stdev(m.kl for m in cuts):.4f}; median standard error a segment reports for "
               f"itself (blocks of {se_block(per)}) {_median(own, '.2f')} points, KL {_median(own_kl, '.4f')}")


def _median(values: list[float], fmt: str) -> str:
    return "-" if not values else f"{statistics.median(values):{fmt}}"


if __name__ == "__main__":
    main()
