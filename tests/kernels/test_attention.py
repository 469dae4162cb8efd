"""The attention entry point against its plain-torch definition, for every mask shape the model builds."""

import pytest
import torch

from qinfer.kernels.attention import attention, attention_ref


def _qkv(T, S, heads=4, kv_heads=2, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(T * 1000 + S)
    q = torch.randn(2, heads, T, D, generator=g, dtype=dtype)
    k = torch.randn(2, kv_heads, S, D, generator=g, dtype=dtype)
    v = torch.randn(2, kv_heads, S, D, generator=g, dtype=dtype)
    return q, k, v


def _mask(T, S, window=None):
    q_pos = torch.arange(S - T, S)[:, None]  # the T newest of S positions
    k_pos = torch.arange(S)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (q_pos - k_pos < window)


@pytest.mark.parametrize(
    "T, S, window",
    [
        (12, 12, None),  # prefill from position 0: a plain causal mask
        (12, 12, 5),  # sliding window shorter than the prompt
        (12, 12, 64),  # sliding window longer than the prompt: causal again
        (5, 12, None),  # prefill of a later chunk against cached keys
        (1, 12, None),  # decode step that sees every key
        (1, 12, 4),  # decode step under a sliding window
    ],
)
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_reference(T, S, window, kv_heads):
    q, k, v = _qkv(T, S, kv_heads=kv_heads)
    mask = _mask(T, S, window)
    torch.testing.assert_close(attention(q, k, v, mask, 0.25), attention_ref(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)


def test_causal_fast_path_is_not_taken_for_other_square_masks():
    q, k, v = _qkv(8, 8)
    mask = _mask(8, 8)
    mask[5, 2] = False  # causal except one pair: must not be treated as causal
    out = attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, attention_ref(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, attention(q, k, v, _mask(8, 8), 0.25))
