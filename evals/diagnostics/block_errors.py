"""Where a quantized model's block outputs differ from the reference's: per block, per sample, per token.

Runs the reference and the quantized model side by side, block by block, on calibration windows drawn as
``qinfer quantize`` draws them (same ``--calib`` source, ``--samples``, ``--seq-len`` and ``--seed``; ``--pick`` of them
are scored: the first ones and the last ``min(16, PICK // 2)``, of the 16 that ``--tune-holdout 16`` keeps out), and
prints each block's mean squared output error, its largest per-sample errors and, after the last block, the ``--top``
tokens with the largest errors and the share of the error the largest 0.1% of tokens (at least one) hold::

    python -m qinfer.evals.diagnostics.block_errors gemma3-270m OUT --samples 512 --seed 1 --blocks 10

Diagnostic only: nothing is written.
"""

import click
import torch

from qinfer.model.arch import ModelConfig
from qinfer.calib.capture import embed_samples, run_block
from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.evals.checkpoint import check_quantized, check_same_model
from qinfer.model.loader import load_model
from qinfer.pipeline.preflight import check_seq_len
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import calibration_batch
from qinfer.sources.resolve import resolve_model
from qinfer.sources.tokenizer import Tokenizer

HELD = 16  # the last samples are scored too: --tune-holdout's, the usual choice


@click.command(cls=Command)
@click.argument("model")
@click.argument("quantized")
@click.option("--calib", default="austen", show_default=True, help="The calibration source, as for qinfer quantize.")
@click.option("--samples", type=int, default=128, show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--pick", type=int, default=64, show_default=True,
              help="Samples scored (at most --samples): the first PICK - H and the last H, H = min(16, PICK // 2).")
@click.option("--blocks", type=int, default=None, help="Blocks to run (default: all).")
@click.option("--top", type=int, default=15, show_default=True, help="Tokens listed after the last block (0: none).")
def main(model, quantized, calib, samples, seq_len, seed, pick, blocks, top):
    _report(model, quantized, calib, samples, seq_len, seed, pick, blocks, top)


@torch.no_grad()
def _report(model, quantized, calib, samples, seq_len, seed, pick, blocks, top):
    folder, quantized_folder = resolve_model(model), resolve_model(quantized)  # both checked before any work
    check_same_model(folder, quantized_folder)
    check_quantized(quantized_folder, quantized)
    config = ModelConfig.from_folder(folder)
    layers = config.num_layers
    if pick < 1 or (blocks is not None and not 1 <= blocks <= layers):
        raise QinferError(f"--pick must be at least 1 and --blocks in 1..{layers} (got {pick}, {blocks})")
    if top < 0:
        raise QinferError(f"--top must be at least 0 (0 lists no tokens); got {top}")
    check_seq_len(seq_len, config.max_position_embeddings)  # qinfer quantize's check
    ids = calibration_batch(folder, CalibConfig(source=calib, samples=samples, seq_len=seq_len, seed=seed))
    pick = min(pick, samples)
    held = min(HELD, pick // 2)
    rows = torch.cat([torch.arange(0, pick - held), torch.arange(samples - held, samples)]).unique()
    ids = ids[rows]
    ref, quant = load_model(folder), load_model(quantized_folder)
    tok = Tokenizer.from_folder(folder)
    X_ref = embed_samples(ref, ids, torch.bfloat16)
    X = X_ref.clone()
    blocks = blocks or ref.config.num_layers
    for i in range(blocks):
        X_ref, X = run_block(ref, i, X_ref), run_block(quant, i, X)
        err = (X.float() - X_ref.float()).pow(2).mean(-1)  # [samples, tokens]
        worst = err.mean(1).argsort(descending=True)[:5]
        print(f"block {i}: mean squared error {float(err.mean()):.3g} (token 0: {float(err[:, 0].mean()):.3g}); "
              "largest samples " + ", ".join(f"#{int(rows[j])} {float(err[j].mean()):.3g}" for j in worst))
    size = X_ref.float().pow(2).mean(-1)
    body = err[:, 1:].flatten()
    order = body.argsort(descending=True)  # one sort for the listing and the share
    for f in order[:top]:
        s, p = divmod(int(f), err.shape[1] - 1)
        p += 1
        print(f"  sample #{int(rows[s])} token {p}: error {float(err[s, p]):.3g}, reference mean square "
              f"{float(size[s, p]):.3g}, text {tok.decode(ids[s, max(0, p - 6):p + 1].tolist())!r}")
    n, total = body.numel(), float(body.sum())
    if total == 0:  # no share of nothing
        print(f"block {blocks - 1}'s outputs equal the reference's after token 0: no squared error to share")
        return
    k = max(1, n // 1000)  # the largest 0.1%, at least one token
    share = float(body[order[:k]].sum()) / total
    print(f"block {blocks - 1}'s squared error after token 0 held by its largest {k} of {n} token errors (0.1%, at "
          f"least one): {share:.0%}")


if __name__ == "__main__":
    main()
