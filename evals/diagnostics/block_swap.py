"""Which blocks carry a quantized model's divergence: its perplexity and KL with each block put back.

Scores the quantized model on the evaluation text as ``qinfer eval`` does (same option checks, same windows, the
reference's logits as the baseline), then again once per decoder block with that one block replaced by the reference's
unquantized block, and prints one line each::

    python -m qinfer.evals.diagnostics.block_swap gemma3-270m OUT [--max-tokens 2048]

A block is the unit because everything a quantization changes stays inside one: AWQ's scales fold into the
block's own norms and linears, and the tuning stages fit the block's norms. A block whose restoring lowers
KL the most is where the most accuracy was lost; the drops need not add up, since the blocks' errors
interact. Diagnostic only: nothing is written, nothing cached.
"""

from dataclasses import replace

import click
import torch
from tqdm import tqdm

from qinfer.cli.command import Command
from qinfer.evals.accuracy import HELDOUT
from qinfer.evals.checkpoint import check_quantized, check_same_model
from qinfer.evals.divergence import text_metrics
from qinfer.evals.forward import LogitsFn, window_logits
from qinfer.evals.runner import EvalConfig, comparison
from qinfer.model.loader import load_model
from qinfer.sources.resolve import resolve_model


@click.command(cls=Command)
@click.argument("model")
@click.argument("quantized")
@click.option("--text", default=HELDOUT, show_default=True, help="'heldout' or a UTF-8 text file, as for qinfer eval.")
@click.option("--max-tokens", type=int, default=2048, show_default=True)
@click.option("--window", type=int, default=512, show_default=True)
@click.option("--stride", type=int, default=256, show_default=True)
def main(model, quantized, text, max_tokens, window, stride):
    _report(model, quantized, text, max_tokens, window, stride)


@torch.no_grad()
def _report(model, quantized, text, max_tokens, window, stride):
    # the checks qinfer eval makes (window, stride, context, vocabulary, tokenization), before any model is loaded
    config = EvalConfig(models=(quantized,), baseline=model, text=text, max_tokens=max_tokens, window=window,
                        stride=stride, tasks=(), speed=False, out=None)
    folder, quantized_folder = resolve_model(model), resolve_model(quantized)
    check_same_model(folder, quantized_folder)  # before the text is read
    check_quantized(quantized_folder, quantized)
    (q,), baseline, tokens, _ = comparison(replace(config, models=(str(quantized_folder),), baseline=str(folder)))
    ref, quant = load_model(baseline.folder), load_model(q.folder)
    bos = baseline.tokenizer.leading_bos  # the reference's, before the windows of both models
    base = _remembered(window_logits(ref, "bf16", bos))  # one reference pass serves all 1 + blocks scores

    def score(label: str) -> None:
        m = text_metrics(base, {label: window_logits(quant, "bf16", bos)}, tokens, window, stride,
                         progress=False)[label]
        tqdm.write(f"{label}: perplexity {m.ppl:.3f}, KL {m.kl:.4g}, top-1 agreement {m.top1_agreement:.1%}")

    score("as quantized")
    layers = quant.model.layers
    for i in tqdm(range(len(layers)), desc="restoring blocks", unit="block"):
        own, layers[i] = layers[i], ref.model.layers[i]
        try:
            score(f"block {i} restored")
        finally:
            layers[i] = own


def _remembered(logits: LogitsFn) -> LogitsFn:
    """``logits``, computing each window once: the reference's logits of the text (bf16, [tokens, vocab]) are kept."""
    seen = {}

    def fn(ids: torch.Tensor, first: int) -> torch.Tensor:
        key = (ids.numpy().tobytes(), first)
        if key not in seen:
            seen[key] = logits(ids, first)
        return seen[key]

    return fn


if __name__ == "__main__":
    main()
