"""GPTQ-style calibration sampling: random fixed-length windows over a stream of token ids.

The stream is the documents' token ids laid end to end, each document tokenized on its own (so a
tokenizer never sees text from two documents at once). Windows may cross document boundaries, as in
the GPTQ and AWQ reference code: calibration wants realistic activations, not aligned documents.

Every source (the Austen novels, a text file, JSONL, a dataset) reaches the quantizers through
:func:`sample_windows`, so a seed means the same thing whatever the source.
"""

from collections.abc import Callable, Sequence

import torch

from qinfer.errors import QinferError

# Tokenize documents until the stream holds this many times the tokens the windows need. Tokenizing a
# whole corpus costs seconds with a fast tokenizer but minutes with a pure-Python one; 4x keeps the cost
# proportional to the request while leaving the windows mostly disjoint.
OVERSAMPLE = 4


def sample_windows(
    documents: Sequence[str],
    tokenize: Callable[[str], Sequence[int]],
    n_samples: int,
    seq_len: int,
    seed: int = 0,
    separator: Sequence[int] = (),
) -> torch.Tensor:
    """Return ``[n_samples, seq_len]`` int64 token ids: windows drawn uniformly from the documents' stream.

    See :func:`sample_windows_from_stream`, which also says how long the stream was.
    """
    return sample_windows_from_stream(documents, tokenize, n_samples, seq_len, seed, separator)[0]


def sample_windows_from_stream(
    documents: Sequence[str],
    tokenize: Callable[[str], Sequence[int]],
    n_samples: int,
    seq_len: int,
    seed: int = 0,
    separator: Sequence[int] = (),
) -> tuple[torch.Tensor, int]:
    """``[n_samples, seq_len]`` int64 token ids drawn uniformly from the documents' stream, and the stream's length.

    Documents are visited in an order shuffled by ``seed`` and tokenized until the stream holds
    ``OVERSAMPLE * n_samples * seq_len`` ids (or the documents run out), so different seeds also draw
    from different parts of a large corpus. The result depends only on the documents, ``tokenize`` and
    the arguments. ``tokenize`` should not add BOS/EOS: they would land mid-window at every document
    boundary. ``separator`` (e.g. ``[eos_id]``) is put between documents instead, if wanted.

    Raises ``QinferError`` if the whole stream is shorter than one window.
    """
    if n_samples < 1 or seq_len < 1:
        raise QinferError(f"calibration needs n_samples >= 1 and seq_len >= 1 (got {n_samples} and {seq_len})")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(documents), generator=generator).tolist()
    budget = OVERSAMPLE * n_samples * seq_len
    ids: list[int] = []
    for index in order:
        if ids and separator:
            ids.extend(separator)
        ids.extend(tokenize(documents[index]))
        if len(ids) >= budget:
            break
    if len(ids) < seq_len:
        raise QinferError(
            f"the calibration text is too short: {len(ids)} tokens from {len(documents)} "
            f"document{'s' * (len(documents) != 1)}, "
            f"fewer than one calibration window ({seq_len} tokens); use a larger source or a smaller --seq-len"
        )
    stream = torch.tensor(ids, dtype=torch.long)
    starts = torch.randint(0, len(ids) - seq_len + 1, (n_samples,), generator=generator)
    # windows: [n_samples, seq_len], row i = stream[starts[i] : starts[i] + seq_len]
    return stream[starts[:, None] + torch.arange(seq_len)], len(ids)


def repeat_note(n_samples: int, seq_len: int, stream_tokens: int) -> str | None:
    """A note when the windows ask for more tokens than the whole text holds (each token then lands in several
    windows, so the statistics are those of a shorter text, repeated), else None."""
    times = n_samples * seq_len / stream_tokens
    if times <= 1:
        return None
    times_text = f"{times:.1f}" if times < 10 else f"{times:.0f}"
    return (f"the calibration text holds {stream_tokens:,} tokens but {n_samples} windows of {seq_len} take "
            f"{n_samples * seq_len:,}: each token is read {times_text} times on average, so the statistics are "
            "those of the shorter text (a longer --calib text gives more varied ones; fewer --samples the same ones "
            "sooner)")
