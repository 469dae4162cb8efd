import importlib
import json
import os
import select
import subprocess
import sys

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.engine.generate import GenerationStats, generate, prefill
from qinfer.engine.sampling import SamplingParams, greedy, sample
from qinfer.model.kv_cache import KVCache, make_cache
from qinfer.model.loader import load_model
from qinfer.sources.tokenizer import Tokenizer
from tests.test_cli_errors import assert_one_line_error, run_qinfer
from tests.tiny_models import make_model

generate_module = importlib.import_module("qinfer.engine.generate")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    make_model("gemma3", folder)
    return load_model(folder, dtype=torch.float32)


def test_greedy_generation_matches_uncached_argmax(tiny):
    prompt = [5, 17, 3, 42]
    got = list(generate(tiny, prompt, SamplingParams(max_tokens=12)))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(tiny(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt):]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_generation_attends_over_a_quantized_cache_with_the_stored_scales(tiny, monkeypatch, kv_dtype):
    # scales that single out one channel (as if calibrated on other text) give it every position's range, so
    # the other channels round to zero: the continuation changes, and is the one a single forward through a
    # cache of that dtype scores (as `qinfer eval --kv-cache` does)
    odd_scale = torch.ones(tiny.config.num_kv_heads, tiny.config.head_dim)
    odd_scale[:, 0] = 1e-6
    monkeypatch.setattr(tiny, "kv_scales", {i: (odd_scale, odd_scale) for i in range(3)})
    prompt = [5, 17, 3, 42]
    plain = list(generate(tiny, prompt, SamplingParams(max_tokens=8)))
    got = list(generate(tiny, prompt, SamplingParams(max_tokens=8), kv_dtype=kv_dtype))
    ids = torch.tensor([prompt + got])
    with torch.no_grad():
        logits = tiny(ids, torch.arange(ids.shape[1]), make_cache(tiny, 1, ids.shape[1], kv_dtype))
    assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == got != plain


def test_stop_ids_end_generation(tiny):
    prompt = [5, 17, 3, 42]
    free = list(generate(tiny, prompt, SamplingParams(max_tokens=8)))
    stats = GenerationStats()
    stopped = list(generate(tiny, prompt, SamplingParams(max_tokens=8), stop_ids=(free[3],), stats=stats))
    assert stopped == free[: free.index(free[3])]
    assert stats.generated_tokens == len(stopped) and stats.prompt_tokens == 4
    # the step that produced the stop id was timed too: the rate counts it, or a short reply reads slow
    assert stats.decode_steps == len(stopped) and stats.decode_tps == pytest.approx(len(stopped) / stats.decode_seconds)


def test_seeded_sampling_is_reproducible(tiny):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    a = list(generate(tiny, [1, 2, 3], params))
    assert a == list(generate(tiny, [1, 2, 3], params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_what_argmax_picks_ties_and_nans_included(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (8, 262144), generator=g).to(dtype)  # every row holds many tied maxima
    logits[3, 1000] = float("nan")
    logits[5, 7] = float("nan")
    logits[5, 9] = float("nan")
    got = greedy(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[3] == 1000 and got[5] == 7 and got.dtype == torch.int64


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100)
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        assert torch.equal(sample(logits, params, g), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 5e-324])
def test_a_tiny_temperature_is_greedy_not_nan(temperature):
    # logits / 1e-40 overflow fp32: the row's largest is taken off first, so the rest go to -inf, not inf - inf
    logits = torch.randn(4, 100) * 30
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingParams(temperature=temperature), g), logits.argmax(-1))


def test_seeds_torch_cannot_take_are_refused():
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))
    for seed in (2**64, -(2**63) - 1, 10**20):
        with pytest.raises(QinferError, match=r"--seed must be in \[-2\*\*63, 2\*\*64 - 1\]"):
            SamplingParams(seed=seed)


def test_top_k_keeps_only_k_tokens():
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(5).indices.tolist())
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingParams(temperature=5.0, top_k=5), g)) for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


def test_context_overflow_is_a_clear_error(tiny):
    with pytest.raises(QinferError, match="context"):
        list(generate(tiny, [1] * 250, SamplingParams(max_tokens=10)))


@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
def test_prefill_in_chunks_matches_one_forward(tiny, chunk):
    # a long prompt runs in chunks against the keys cached before each; the tiny gemma3 has a sliding window
    # of 5, so chunks of 3 and 5 cross it
    ids = torch.randint(1, tiny.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = tiny(ids)[:, -1]
        cache = KVCache(tiny.config, 1, 16, torch.float32)
        got = prefill(tiny, ids, cache, chunk=chunk)
        step = tiny(torch.tensor([[7]]), torch.tensor([13]), cache)[:, -1]  # a decode step on the chunked cache
        expected_step = tiny(torch.cat([ids, torch.tensor([[7]])], dim=1))[:, -1]
    torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, expected_step, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("run", [False, True])
def test_compiled_decoding_gives_the_eager_tokens_and_compiles_once(tiny, tmp_path, run):
    # the tiny gemma3's sliding window (5) is crossed: the compiled step takes every position without recompiling;
    # run: loaded as the qinfer commands load a model to run (q/k/v and gate/up fused)
    if run:
        make_model("gemma3", tmp_path)
        tiny = load_model(tmp_path, dtype=torch.float32, run=True)
        assert tiny.model.layers[0].self_attn.fused is not None
    params = SamplingParams(max_tokens=10)
    first, again = GenerationStats(), GenerationStats()
    assert list(generate(tiny, [5, 17, 3, 42], params, stats=first, compiled=True)) == list(
        generate(tiny, [5, 17, 3, 42], params))
    longer = [5, 17, 3, 42, 8, 9, 10]  # another prompt length and cache size: the same compiled step
    assert list(generate(tiny, longer, params, stats=again, compiled=True)) == list(generate(tiny, longer, params))
    assert (first.compile_steps, again.compile_steps) == (1, 0) and first.compile_seconds > 0
    assert not generate_module.compile_error()
    assert "compiling the decode step" in first.summary() and "compiling" not in again.summary()
    # the compiling step's time is kept out of the decode rate: 10 tokens = prefill's + 9 steps, 1 of them compiling
    assert first.decode_tps == pytest.approx(8 / first.decode_seconds)


def test_a_failing_compile_decodes_eagerly_and_says_why(tiny, monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler found\nthe rest of a long message")

    monkeypatch.setattr(generate_module, "compiled_decode_step", lambda: broken)
    monkeypatch.setattr(generate_module, "_COMPILE_ERRORS", [])
    params = SamplingParams(max_tokens=6)
    stats = GenerationStats()
    eager = list(generate(tiny, [5, 17, 3], params))
    assert list(generate(tiny, [5, 17, 3], params, stats=stats, compiled=True)) == eager
    assert generate_module.compile_error() == "RuntimeError: no C++ compiler found"
    assert generate_module._COMPILE_ERRORS == [generate_module.compile_error()]  # tried once, then eager
    assert stats.compile_steps == 1 and stats.generated_tokens == 6  # the failed attempt's time is kept apart


def test_cli_generate_and_chat_with_compile(tmp_path):
    make_model("llama", tmp_path)
    plain = run_qinfer("generate", str(tmp_path), "a b", "--max-tokens", "6")
    compiled = run_qinfer("generate", str(tmp_path), "a b", "--max-tokens", "6", "--compile")
    assert plain.returncode == 0 and compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == plain.stdout  # greedy: the same text
    assert "compiling the decode step" in compiled.stderr and "Traceback" not in compiled.stderr

    def chat(*flags):
        return subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "6", *flags],
                              input="hello\nhello again\n", capture_output=True, text=True, timeout=300)

    eager, compiled = chat(), chat("--compile")
    assert compiled.returncode == 0 and "Traceback" not in compiled.stderr, compiled.stderr
    assert "note: --compile" in compiled.stderr
    assert compiled.stdout == eager.stdout and len(compiled.stdout.strip().splitlines()) == 2  # two replies


def test_a_request_longer_than_the_context_is_refused_before_any_output(tmp_path):
    make_model("llama", tmp_path)  # a context of 256 positions
    long = " ".join(["word"] * 300)
    proc = run_qinfer("generate", str(tmp_path), long, "--max-tokens", "3")
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr  # not even the prompt
    assert proc.stderr.strip().splitlines()[-1].startswith("Error: prompt (") and "context of 256" in proc.stderr
    # in a chat, that turn is refused and dropped; the conversation goes on
    chat = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "6"],
                          input=f"hello\n{long}\nhello again\n", capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr
    replies = chat.stdout.strip().splitlines()
    assert len(replies) == 3 and "exceeds the model's context" in replies[1] and "/reset" in replies[1]
    assert "exceeds" not in replies[0] + replies[2]


def test_one_token_has_no_decode_rate_to_report():
    """The only token came out of prefill: no decode step was timed, so no "0.0 tok/s" either."""
    one = GenerationStats(prompt_tokens=3, generated_tokens=1, prefill_seconds=0.5).summary()
    assert one == "prefill 3 tok at 6.0 tok/s, decode 1 tok (no decode step after prefill's to time)"
    three = GenerationStats(prompt_tokens=3, generated_tokens=3, prefill_seconds=0.5, decode_seconds=0.5,
                            decode_steps=2).summary()
    assert three.endswith("decode 3 tok at 4.0 tok/s")


def test_chat_refuses_max_tokens_that_leave_no_room_for_a_prompt(tmp_path):
    make_model("llama", tmp_path)  # a context of 256 positions
    proc = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "256"],
                          input="hello\n", capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "--max-tokens 256 leaves no room for a prompt in the model's context of 256 tokens")


def test_chat_drops_a_turn_its_template_refuses_and_refuses_a_system_message_it_cannot_take(tmp_path):
    make_model("llama", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (  # no system role; a message "bad" is refused
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% if m['content'] == 'bad' %}{{ raise_exception('bad content') }}{% endif %}"
        "<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    def chat(text, *flags):
        return subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "4", *flags],
                              input=text, capture_output=True, text=True, timeout=300)

    proc = chat("hello\nbad\ngood\n")  # the refused turn is not kept: the next one runs
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    replies = proc.stdout.strip().splitlines()
    assert len(replies) == 3 and "bad content" in replies[1] and "/reset" not in replies[1]
    assert "failed" not in replies[0] + replies[2]
    assert_one_line_error(chat("hello\n", "--system", "be brief"), "no system role", "drop --system")


def test_cli_compile_without_a_compiler_decodes_eagerly_with_a_note(tmp_path):
    make_model("llama", tmp_path / "m")
    plain = run_qinfer("generate", str(tmp_path / "m"), "a b", "--max-tokens", "6")
    # no C++ compiler for inductor (and an empty cache of its own, so nothing compiled before is reused)
    broken = run_qinfer("generate", str(tmp_path / "m"), "a b", "--max-tokens", "6", "--compile",
                        env={"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert broken.returncode == 0 and "Traceback" not in broken.stderr, broken.stderr
    assert broken.stdout == plain.stdout
    notes = [line for line in broken.stderr.splitlines() if line.startswith("note: --compile failed")]
    assert len(notes) == 1 and "compiler" in notes[0] and notes[0].endswith("decoded without it")


def test_chat_refuses_max_tokens_that_leave_no_room_for_a_first_turn(tmp_path):
    make_model("llama", tmp_path)  # a context of 256 positions; the template and "Hello." take more than 4
    proc = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "252"],
                          input="hello\n", capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "--max-tokens 252 leaves no room for a first turn", "lower --max-tokens")


def test_chat_refuses_a_system_message_that_leaves_no_room_for_a_first_turn(tmp_path):
    make_model("llama", tmp_path)  # a context of 256 positions: every turn after this system message would fail
    proc = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "4",
                           "--system", " ".join(["word"] * 300)], input="hello\n", capture_output=True, text=True,
                          timeout=300)
    assert_one_line_error(proc, "leaves no room for a first turn: the template, --system and a word take",
                          "shorten --system")


def test_generate_and_chat_run_over_the_kv_cache_asked_for_with_the_stored_scales(tmp_path):
    from safetensors.torch import load_file, save_file

    from qinfer.format import QuantScheme
    from qinfer.pipeline.config import CalibConfig
    from qinfer.pipeline.quantize import quantize_model
    from tests.tiny_models import TEXT

    make_model("llama", tmp_path / "src")
    (tmp_path / "calib.txt").write_text(TEXT * 8)
    out = tmp_path / "q"
    quantize_model(tmp_path / "src", out, QuantScheme(method="rtn", group_size=32, kv_cache="int8"),
                   CalibConfig(source=str(tmp_path / "calib.txt"), samples=4, seq_len=32))
    # scales that single out one channel: it takes every position's range, and the others round to zero
    tensors = load_file(out / "model.safetensors")
    odd = {k: torch.ones_like(t).index_fill_(-1, torch.tensor([0]), 1e-6) for k, t in tensors.items()
           if k.endswith(("k_scale", "v_scale"))}
    assert len(odd) == 6
    save_file({**tensors, **odd}, out / "model.safetensors", metadata={"format": "pt"})

    def generate_cli(kv):
        proc = run_qinfer("generate", str(out), "It is a truth", "--max-tokens", "8", "--dtype", "fp32",
                          "--kv-cache", kv)
        assert proc.returncode == 0, proc.stderr
        assert "stores no KV-cache scales" not in proc.stderr
        return proc.stdout

    model, tok = load_model(out, dtype=torch.float32), Tokenizer.from_folder(out)
    ids = list(generate(model, tok.encode("It is a truth"), SamplingParams(max_tokens=8), kv_dtype="int8"))
    assert generate_cli("int8") == "It is a truth" + tok.decode(ids) + "\n" != generate_cli("bf16")

    def chat_cli(kv):
        proc = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(out), "--max-tokens", "12", "--dtype",
                               "fp32", "--kv-cache", kv], input="hello\n", capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert chat_cli("int8") != chat_cli("bf16")
    # a folder without scales: an int8 cache says what it does instead, and how to calibrate; FP8 does about
    # as well without (docs/format.md): no note
    proc = run_qinfer("generate", str(tmp_path / "src"), "It is", "--max-tokens", "2", "--kv-cache", "fp8")
    assert proc.returncode == 0, proc.stderr
    assert "KV-cache scales" not in proc.stderr
    proc = run_qinfer("generate", str(tmp_path / "src"), "It is", "--max-tokens", "2", "--kv-cache", "int8")
    assert proc.returncode == 0, proc.stderr
    assert ("stores no KV-cache scales, so the int8 cache scales each position's keys and values alike over their "
            "channels (less accurate: quantizing the original model with --kv-cache int8 calibrates scales per "
            "channel)") in proc.stderr


def test_an_empty_system_message_is_sent_as_one(tmp_path):
    from qinfer.engine.chat import ChatSession

    make_model("llama", tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    session = ChatSession(load_model(tmp_path, dtype=torch.float32), tok, SamplingParams(max_tokens=2), system="")
    assert session.messages == [{"role": "system", "content": ""}] and not session.has_history
    "".join(session.reply("hi"))
    assert session.has_history
    prompt = tok.apply_chat_template(session.messages[:2], add_generation_prompt=True)
    assert prompt.startswith("<s>system\n</s>\n<s>user\nhi</s>\n")  # as transformers renders it
    session.reset()
    assert session.messages == [{"role": "system", "content": ""}]


def test_a_ctrl_c_before_the_answer_begins_keeps_no_half_turn(tmp_path, monkeypatch):
    # a Ctrl-C while the turn's request is being queued: the question is dropped, so the next turn's history still
    # alternates (Gemma's, Mistral's and Llama 2's templates refuse two user messages in a row)
    from qinfer.engine.chat import ChatSession

    make_model("llama", tmp_path)
    session = ChatSession(load_model(tmp_path, dtype=torch.float32), Tokenizer.from_folder(tmp_path),
                          SamplingParams(max_tokens=2))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(session.engine, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        "".join(session.reply("first"))
    assert session.messages == []
    monkeypatch.undo()
    "".join(session.reply("second"))
    assert [(m["role"], m["content"]) for m in session.messages][0] == ("user", "second")
    assert [m["role"] for m in session.messages] == ["user", "assistant"]


def test_a_chat_turn_reuses_the_conversation_the_engine_holds(tmp_path):
    from qinfer.engine.chat import ChatSession

    make_model("llama", tmp_path)
    session = ChatSession(load_model(tmp_path, dtype=torch.float32), Tokenizer.from_folder(tmp_path),
                          SamplingParams(max_tokens=12))
    first, second = GenerationStats(), GenerationStats()
    "".join(session.reply("It is a truth universally acknowledged, that a single man", first))
    "".join(session.reply("However little known the feelings", second))
    assert first.cached_tokens == 0
    assert 16 <= second.cached_tokens < second.prompt_tokens  # whole blocks of the first turn, prompt and answer
    assert "cached)" in second.summary()


def test_chat_says_reset_only_when_there_is_a_conversation_to_clear(tmp_path):
    make_model("llama", tmp_path)
    long = " ".join(["word"] * 300)
    chat = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "6"],
                          input=f"{long}\nhello\n/reset\n{long}\n", capture_output=True, text=True, timeout=300)
    replies = chat.stdout.strip().splitlines()
    assert chat.returncode == 0 and len(replies) == 4, chat.stderr
    assert "exceeds the model's context" in replies[0] and "/reset" not in replies[0]
    assert "exceeds the model's context" in replies[3] and "/reset" not in replies[3]


def test_an_error_of_the_machine_ends_generate_and_chat_on_a_line_of_its_own(tmp_path):
    # the C kernels are built into the cache at the first forward: a file where the cache goes is no turn's fault
    make_model("llama", tmp_path / "m")
    (tmp_path / "cache").write_text("not a folder")
    env = {"QINFER_CACHE": str(tmp_path / "cache")}
    proc = run_qinfer("generate", str(tmp_path / "m"), "Once upon", "--max-tokens", "3", env=env)
    assert_one_line_error(proc, "cannot write QINFER_CACHE")
    assert proc.stdout == "Once upon\n"  # the error's line is not glued to the prompt at a terminal
    chat = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path / "m"), "--max-tokens", "3"],
                          input="hello\nagain\n", capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert chat.returncode == 1 and chat.stdout == "\n", (chat.stdout, chat.stderr)
    assert_one_line_error(chat, "cannot write QINFER_CACHE")


def test_chat_names_input_that_is_not_utf8_in_a_strict_locale(tmp_path):
    # PYTHONIOENCODING=utf-8 reads stdin strictly, as an en_US.UTF-8 locale does (C.UTF-8 escapes bad bytes)
    make_model("llama", tmp_path)
    chat = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "3"],
                          input=b"caf\xe9 ok\nhello\n", capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    replies = chat.stdout.decode().strip().splitlines()
    assert chat.returncode == 0 and b"Traceback" not in chat.stderr, chat.stderr
    assert len(replies) == 2 and "not valid UTF-8 (byte 0xe9" in replies[0]


ECHO_CHAT = """
from qinfer.engine.chat import repl
class Echo:
    compiled, system, has_history = False, None, False
    def reset(self): pass
    def reply(self, text): yield "[" + text + "]"
repl(Echo())
"""


def test_chat_answers_its_commands_and_sends_no_mistyped_one_to_the_model():
    proc = subprocess.run([sys.executable, "-c", ECHO_CHAT], capture_output=True, text=True, timeout=60,
                          input="/help\n/rest\n/usr/bin is a folder\nhi\n/exit\nnot read\n")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("(/reset clears the conversation") and "/help" in lines[0]
    assert lines[1].startswith("(unknown command /rest: /reset clears")
    assert lines[2:] == ["[/usr/bin is a folder]", "[hi]"]  # a line that is more than one word is a turn


def test_chat_at_a_terminal_edits_the_line():
    # typed "ab", left arrow, "X", Enter: the turn is "aXb", as in any readline prompt
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", ECHO_CHAT], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out = b""

    def read_until(needle: bytes, times: int = 1) -> None:
        nonlocal out
        while out.count(needle) < times and select.select([master], [], [], 60)[0]:
            try:
                out += os.read(master, 4096)
            except OSError:  # the child closed the terminal
                return

    read_until(b">>> ")
    os.write(master, b"ab\x1b[DX\r")
    # Ctrl-D only at the next prompt: readline has the terminal in its own mode then (a ^D sent while the line
    # discipline was still canonical, between prompts, could be lost on a loaded machine: a 60 s hang in CI)
    read_until(b">>> ", times=2)
    os.write(master, b"\x04")
    assert proc.wait(timeout=60) == 0
    os.close(master)
    assert b"[aXb]" in out, out


@pytest.mark.parametrize("after", [0, 3])
def test_ctrl_c_ends_generates_line_and_says_how_far_it_got(tmp_path, monkeypatch, after):
    # Ctrl-C (here raised after `after` tokens) is no error: the text so far ends its line, the timing line
    # says where it stopped, and the exit status is 130 as for any Ctrl-C
    from click.testing import CliRunner

    from qinfer.cli.commands import cli

    make_model("llama", tmp_path)
    real = generate_module.generate

    def interrupted(*args, **kwargs):
        tokens = real(*args, **kwargs)

        def stream():
            for _ in range(after):
                yield next(tokens)
            raise KeyboardInterrupt

        return stream()

    monkeypatch.setattr(generate_module, "generate", interrupted)
    result = CliRunner().invoke(cli, ["generate", str(tmp_path), "a b", "--max-tokens", "8"])
    assert result.exit_code == 130 and "Error" not in result.stderr, result.stderr
    assert result.stdout.startswith("a b") and result.stdout.endswith("\n")
    stopped = "stopped (Ctrl-C): " + ("before the first token" if after == 0 else "prefill ")
    assert result.stderr.strip().startswith(stopped), result.stderr
    if after:
        assert "decode 3 tok" in result.stderr


@pytest.mark.parametrize("failure", ["sigterm", "error"])
def test_a_generation_ended_mid_way_puts_its_error_on_a_line_of_its_own(tmp_path, monkeypatch, failure):
    import signal

    from click.testing import CliRunner

    import qinfer.engine.generate as generate_module
    from qinfer.cli.commands import cli
    from qinfer.errors import Terminated

    make_model("llama", tmp_path)

    def cut_short(model, prompt_ids, params, **kwargs):
        yield from prompt_ids[:3]
        raise Terminated(128 + signal.SIGTERM) if failure == "sigterm" else QinferError("the model went away")

    monkeypatch.setattr(generate_module, "generate", cut_short)
    result = CliRunner().invoke(cli, ["generate", str(tmp_path), "Hello world, hello"])
    assert result.exit_code == (128 + signal.SIGTERM if failure == "sigterm" else 1)
    errors = [line for line in result.output.splitlines() if "Error:" in line]
    assert len(errors) == 1 and errors[0].startswith("Error:"), result.output
