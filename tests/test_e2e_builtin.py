"""End to end on the real built-in models, as a user runs them (slow: pulls ~340 MB once per machine)."""

import os
import pty
import select
import subprocess
import sys
import time

import pytest
import torch

from tests.test_cli_errors import run_qinfer

pytestmark = pytest.mark.slow


def test_pull_and_list():
    proc = run_qinfer("pull", "gemma3-270m", timeout=1800)
    assert proc.returncode == 0, proc.stderr
    listing = run_qinfer("list")
    assert "gemma3-270m" in listing.stdout and "cached at" in listing.stdout


def test_generate_gemma3_knows_paris():
    from qinfer.model.loader import load_model
    from qinfer.sources.registry import pull
    from qinfer.sources.tokenizer import Tokenizer

    proc = run_qinfer("generate", "gemma3-270m", "The capital of France is", "--max-tokens", "20", timeout=1800)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is")
    assert "decode" in proc.stderr and "tok/s" in proc.stderr
    # This base model's greedy continuation is " the capital of the country of France..."; " Paris" is its
    # third most likely next token (transformers agrees on the same weights). A question prompt says it outright.
    folder = pull("gemma3-270m")
    model, tok = load_model(folder), Tokenizer.from_folder(folder)
    with torch.no_grad():
        top3 = model(torch.tensor([tok.encode("The capital of France is")]))[0, -1].topk(3).indices.tolist()
    assert tok.token_to_id("▁Paris") in top3
    qa = run_qinfer("generate", "gemma3-270m", "Question: What is the capital of France?\nAnswer:", "--max-tokens", "4")
    assert qa.stdout.split("Answer:")[1].strip().startswith("Paris"), qa.stdout


def test_chat_smollm2_through_a_pipe():
    proc = subprocess.run(
        [sys.executable, "-m", "qinfer", "chat", "smollm2-135m-instruct", "--max-tokens", "30"],
        input="What is the capital of France?\n/reset\nWhat is the capital of France?\n",
        capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Paris") >= 2 and "(conversation cleared)" in proc.stdout


def _read_until(fd, needle: bytes, timeout: float) -> bytes:
    out, deadline = b"", time.time() + timeout
    while needle not in out and time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    return out


def test_chat_smollm2_in_a_terminal_ctrl_c_and_eof():
    pid, fd = pty.fork()
    if pid == 0:  # child: the chat, attached to a pseudo-terminal
        os.execv(sys.executable, [sys.executable, "-m", "qinfer", "chat", "smollm2-135m-instruct", "--max-tokens", "400"])
    try:
        assert b">>> " in _read_until(fd, b">>> ", 600)
        os.write(fd, b"Write a very long story about a dragon.\n")
        time.sleep(3)
        os.write(fd, b"\x03")  # Ctrl-C: stops this reply, not the session
        assert b">>> " in _read_until(fd, b">>> ", 120)
        os.write(fd, b"What is the capital of France?\n")
        answer = _read_until(fd, b">>> ", 300)
        assert b"Paris" in answer
        os.write(fd, b"\x04")  # Ctrl-D at the prompt: EOF, clean exit
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_perplexity_matches_transformers_on_heldout_text():
    import transformers

    from qinfer.calib.austen import heldout_text
    from qinfer.evals.perplexity import perplexity
    from qinfer.model.loader import load_model
    from qinfer.sources.registry import pull
    from qinfer.sources.tokenizer import Tokenizer

    folder = pull("gemma3-270m")
    tokens = torch.tensor(Tokenizer.from_folder(folder).encode(heldout_text()))[:2048]
    ours = load_model(folder, dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        p_ours = perplexity(lambda ids: ours(ids), tokens, window=512, stride=256, progress=False).ppl
        p_ref = perplexity(lambda ids: ref(ids).logits, tokens, window=512, stride=256, progress=False).ppl
    assert abs(p_ours - p_ref) / p_ref < 0.01, (p_ours, p_ref)
