"""Tokenizer: SentencePiece models built from GGUF vocabularies, the tokenizers backend, BOS, streaming, templates."""

import json
import os
import shutil
from pathlib import Path

import pytest
from sentencepiece import SentencePieceProcessor

import qinfer.sources.tokenizer as tokenizer_module
from qinfer.errors import QinferError
from qinfer.sources.gguf_convert import generation_config
from qinfer.sources.gguf_vocab import GGUFVocab, resolve_special_tokens, sentencepiece_proto, write_tokenizer_files
from qinfer.sources.tokenizer import StreamDecoder, Tokenizer
from tests.conftest import builtin_gguf
from tests.gguf_fixtures import CHATML_TEMPLATE, bpe_vocab_metadata, sp_vocab_metadata

TEXTS = [
    "Hello world",
    " Hello",
    "The capital of France is Paris.",
    "Hello   world\n\nnew  line\n  indented 123 4567,89",
    "naïve café – 日本語 🤖!",
    "   leading and trailing   ",
    "",
]


def _folder(tmp_path: Path, meta: dict, name: str = "tok") -> Path:
    vocab = GGUFVocab.from_metadata(meta)
    folder = tmp_path / name
    folder.mkdir()
    specials = resolve_special_tokens(vocab)
    write_tokenizer_files(vocab, specials, folder)
    (folder / "generation_config.json").write_text(json.dumps(generation_config(specials)))
    return folder


@pytest.fixture
def sp_tok(tmp_path) -> Tokenizer:
    return Tokenizer.from_folder(_folder(tmp_path, sp_vocab_metadata()))


@pytest.fixture
def bpe_tok(tmp_path) -> Tokenizer:
    return Tokenizer.from_folder(_folder(tmp_path, bpe_vocab_metadata()))


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok._backend.id_to_token(i) for i in tok.encode(text, add_bos=False)]


# --- SentencePiece from a GGUF vocabulary -------------------------------------------------------------------


def test_sentencepiece_proto_settings():
    meta = sp_vocab_metadata()
    vocab = GGUFVocab.from_metadata(meta)
    proto = sentencepiece_proto(vocab, resolve_special_tokens(vocab))
    assert proto.trainer_spec.model_type == proto.trainer_spec.BPE
    assert proto.trainer_spec.byte_fallback and proto.trainer_spec.split_digits
    assert proto.normalizer_spec.name == "identity"
    assert not proto.normalizer_spec.add_dummy_prefix and not proto.normalizer_spec.remove_extra_whitespaces
    types = {p.piece: p.type for p in proto.pieces}
    assert types["<bos>"] == 3 and types["<unk>"] == 2 and types["<0x41>"] == 6 and types["Hello"] == 1
    assert types["▁▁"] == 4  # llama.cpp's "  " back in SentencePiece's spelling
    sp = SentencePieceProcessor(model_proto=proto.SerializeToString())
    assert sp.get_piece_size() == len(meta["tokenizer.ggml.tokens"])
    assert (sp.bos_id(), sp.eos_id(), sp.unk_id(), sp.pad_id()) == (2, 1, 3, 0)


def test_a_gguf_without_token_types_still_makes_a_sentencepiece_model(tmp_path):
    # tokenizer.ggml.token_type is optional (llama.cpp then finds the specials by id and byte pieces by their text);
    # SentencePiece loads no model without a piece typed UNKNOWN
    meta = sp_vocab_metadata()
    del meta["tokenizer.ggml.token_type"]
    tok = Tokenizer.from_folder(_folder(tmp_path, meta))
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    vocab = GGUFVocab.from_metadata(meta)
    types = {p.piece: p.type for p in sentencepiece_proto(vocab, resolve_special_tokens(vocab)).pieces}
    assert (types["<unk>"], types["<bos>"], types["<eos>"], types["<0x41>"], types["Hello"]) == (2, 3, 3, 6, 1)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer_config.json", b'{"x": "Smol\xffM"}', r"tokenizer_config.json is not UTF-8 text \(byte 11\)"),
        ("generation_config.json", b"[1, 2]", "generation_config.json holds a JSON list, not an object"),
        ("chat_template.jinja", b'{{ "caf\xe9" }}', r"chat_template.jinja is not UTF-8 text"),
    ],
)
def test_unreadable_tokenizer_side_files_are_one_line(tmp_path, name, content, message):
    folder = _folder(tmp_path, sp_vocab_metadata())
    (folder / name).write_bytes(content)
    with pytest.raises(QinferError, match=message):
        Tokenizer.from_folder(folder)


@pytest.mark.parametrize("meta", [sp_vocab_metadata, bpe_vocab_metadata], ids=["tokenizer.model", "tokenizer.json"])
def test_a_folder_whose_name_is_not_utf8_loads(tmp_path, meta):
    made = _folder(tmp_path, meta())
    named = Path(shutil.copytree(made, tmp_path / os.fsdecode(b"caf\xe9")))  # Latin-1 bytes from an old archive
    for text in TEXTS:
        assert Tokenizer.from_folder(named).encode(text) == Tokenizer.from_folder(made).encode(text)



@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_round_trip(sp_tok, text):
    assert sp_tok.decode(sp_tok.encode(text)) == text


def test_sentencepiece_pieces_no_dummy_prefix(sp_tok):
    assert _pieces(sp_tok, "Hello") == ["Hello"]
    assert _pieces(sp_tok, " Hello") == ["▁Hello"]
    assert _pieces(sp_tok, "The capital of France is") == ["The", "▁capital", "▁of", "▁France", "▁is"]
    assert _pieces(sp_tok, "a  b") == ["a", "▁▁", "b"]  # user-defined whitespace piece matches
    assert _pieces(sp_tok, "x\n\ny") == ["x", "\n\n", "y"]
    assert _pieces(sp_tok, "日") == ["<0xE6>", "<0x97>", "<0xA5>"]  # byte fallback


def test_sentencepiece_special_tokens_in_text(sp_tok):
    ids = sp_tok.encode("<start_of_turn>user\nHello<end_of_turn>", add_bos=False)
    assert ids[0] == sp_tok.token_to_id("<start_of_turn>") == 4
    assert ids[-1] == sp_tok.token_to_id("<end_of_turn>") == 5
    assert sp_tok.decode(ids) == "user\nHello"
    assert sp_tok.decode(ids, skip_special_tokens=False) == "<start_of_turn>user\nHello<end_of_turn>"


def test_sentencepiece_bos(sp_tok):
    assert sp_tok.bos_id == 2 and sp_tok.eos_ids == (1, 5)  # <eos>, then <end_of_turn> from generation_config
    hello = sp_tok.encode("Hello", add_bos=False)
    assert sp_tok.encode("Hello") == [2] + hello
    assert sp_tok.encode("<bos>Hello") == [2] + hello  # a BOS written by a template is not doubled
    assert sp_tok.encode("<bos>Hello", add_bos=False) == [2] + hello



def test_a_dummy_prefix_model_encodes_as_sentencepiece_does(tmp_path):
    """A Llama-style tokenizer.model alone is sentencepiece's: each stretch of text between special tokens gets
    the model's dummy prefix, and a leading space stays a space of its own (transformers 5's converted fast
    tokenizer gives "▁Hello" for " Hello" and drops the prefix after a special token)."""
    meta = sp_vocab_metadata()
    meta["tokenizer.ggml.add_space_prefix"] = True
    folder = _folder(tmp_path, meta)
    tok, sp = Tokenizer.from_folder(folder), SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    for text in TEXTS:
        assert tok.encode(text, add_bos=False) == sp.encode(text)
    turn, end = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
    assert tok.encode("<start_of_turn>user Hello<end_of_turn> is", add_bos=False) == [
        turn, *sp.encode("user Hello"), end, *sp.encode(" is")]
    assert _pieces(tok, " Hello") == ["▁▁", "Hello"]

@pytest.mark.parametrize("backend", ["sp_tok", "bpe_tok"])
def test_ids_past_the_tokenizer_decode_to_nothing(request, backend):
    # a config.json vocab_size padded past the tokenizer (Gemma 3 4B: 262208 rows, 262144 pieces): a sampled
    # padding id prints nothing, as in transformers, in both backends and in the stream
    tok = request.getfixturevalue(backend)
    hello, world = tok.encode("Hello", add_bos=False), tok.encode(" world", add_bos=False)
    ids = hello + [tok.vocab_size + 7] + world
    assert tok.decode(ids) == tok.decode(hello + world) == "Hello world"
    stream = StreamDecoder(tok)
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == "Hello world"


@pytest.mark.parametrize("rows", [lambda n: n // 3, lambda n: 3 * n])
def test_another_models_tokenizer_is_refused(tmp_path, rows):
    folder = _folder(tmp_path, sp_vocab_metadata())
    n = Tokenizer.from_folder(folder).vocab_size
    (folder / "config.json").write_text(json.dumps({"vocab_size": rows(n)}))
    with pytest.raises(QinferError, match=f"tokenizer has {n} tokens but config.json vocab_size is {rows(n)}"):
        Tokenizer.from_folder(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": n + 64}))  # padding rows are normal
    assert Tokenizer.from_folder(folder).model_vocab_size == n + 64


@pytest.mark.parametrize("eos", [["x"], "2", 2.5])
def test_an_eos_token_id_that_is_no_id_is_refused(tmp_path, eos):
    folder = _folder(tmp_path, sp_vocab_metadata())
    (folder / "config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(QinferError, match=r"eos_token_id .* is not a token id or a list of them; fix it in config.json"):
        Tokenizer.from_folder(folder)


def test_gguf_bos_eos_resolved_by_text(tmp_path):
    tok = Tokenizer.from_folder(_folder(tmp_path, sp_vocab_metadata(bos_id=1, eos_id=1)))
    assert tok.bos_id == 2 and tok.eos_ids == (1, 5)
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")


# --- byte-level BPE through the tokenizers library ---------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_round_trip(bpe_tok, text):
    assert bpe_tok.decode(bpe_tok.encode(text)) == text


def test_bpe_pieces_and_digits(bpe_tok):
    assert _pieces(bpe_tok, "Hello world") == ["Hello", "Ġworld"]
    # The vocabulary has a "12" merge, but SmolLM's pre-tokenizer splits every digit
    assert _pieces(bpe_tok, "12") == ["1", "2"]
    assert bpe_tok.encode("<|im_start|>user", add_bos=False)[0] == 1


def test_bpe_without_bos(bpe_tok):
    assert bpe_tok.bos_id == 1 and bpe_tok.eos_ids == (2,)
    assert bpe_tok.encode("Hello") == bpe_tok.encode("Hello", add_bos=False) == [bpe_tok.token_to_id("Hello")]


def test_bpe_post_processor_bos_not_doubled(tmp_path):
    tok = Tokenizer.from_folder(_folder(tmp_path, bpe_vocab_metadata(add_bos=True)))
    hello = tok.token_to_id("Hello")
    assert tok.encode("Hello") == [1, hello]
    assert tok.encode("Hello", add_bos=False) == [hello]
    assert tok.encode("<|im_start|>Hello") == [1, hello]


def test_bpe_post_processor_decides_without_config(tmp_path):
    folder = _folder(tmp_path, bpe_vocab_metadata(add_bos=True))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["add_bos_token"]  # a user folder that leaves BOS to tokenizer.json's post-processor
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(folder)
    assert tok.encode("Hello") == [1, tok.token_to_id("Hello")]


def test_transformers_reads_the_same_tokenizer_json(tmp_path):
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, bpe_vocab_metadata())
    ours, theirs = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS + ["<|im_start|>user\nHi<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text)


# --- streaming ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sp_tok", "bpe_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(request, backend, text):
    tok = request.getfixturevalue(backend)
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    pieces = [stream.feed(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # a split character is held back, never shown broken


def test_stream_multibyte_and_leading_space(sp_tok):
    stream = StreamDecoder(sp_tok)
    ids = sp_tok.encode("Hello 🤖 world", add_bos=False)
    out = [stream.feed(i) for i in ids]
    assert out[0] == "Hello"
    emoji = out[1:-1]  # "▁", then four byte tokens, then "▁world"
    assert emoji[:1] == [" "] and emoji[1:4] == ["", "", ""] and emoji[4] == "🤖"
    assert out[-1] == " world"  # the piece's leading space survives decoding it in a window
    assert stream.flush() == ""


@pytest.mark.parametrize("decoder", ["metaspace", "strip"])
def test_stream_continuing_a_prompt_keeps_the_first_pieces_space(tmp_path, decoder):
    # `qinfer generate` prints the prompt, then the stream. Llama 2 / Mistral tokenizers drop the leading space of
    # the first piece decoded (a Metaspace decoder, or the older Replace, ..., Strip(left=1)): "isParis" unless the
    # stream starts from the prompt's last token
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    hf.decoder = (decoders.Metaspace(replacement="\u2581", prepend_scheme="first") if decoder == "metaspace" else
                  decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]))
    hf.train_from_iterator(["The capital of France is Paris."] * 20,
                           trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer.from_folder(tmp_path)
    prompt = tok.encode("The capital of France is")
    continuation = tok.encode("The capital of France is Paris.")[len(prompt):]
    assert tok.decode(continuation[:1]).startswith("P")  # decoded alone, the piece loses its space
    stream = StreamDecoder(tok, context=prompt[-1:])
    assert "".join(stream.feed(i) for i in continuation) + stream.flush() == " Paris."


def test_stream_flush_returns_unfinished_character(sp_tok):
    stream = StreamDecoder(sp_tok)
    first_two_bytes = sp_tok.encode("日", add_bos=False)[:2]
    assert [stream.feed(i) for i in first_two_bytes] == ["", ""]
    assert stream.flush() == sp_tok.decode(first_two_bytes)


def test_stream_sends_what_precedes_an_unfinished_character_and_holds_no_broken_run_for_long(sp_tok):
    # a model that emits bytes that are no UTF-8 (a tiny random one) must still stream, and at a cost that does not
    # grow with the run: the U+FFFD run is held back for at most HOLD tokens
    stream = StreamDecoder(sp_tok)
    word, lead, stray = sp_tok.encode("ab", add_bos=False), sp_tok.encode("日", add_bos=False)[:1], \
        sp_tok.token_to_id("<0xFF>")  # the first of three bytes, and a byte no UTF-8 text has
    assert stray is not None
    ids = word + lead + [stray] * 12 + word
    out = [stream.feed(i) for i in ids]
    assert "".join(out[:len(word)]) == "ab" and out[len(word)] == ""  # the lead byte may begin a character
    assert "\ufffd" in "".join(out[:len(word) + StreamDecoder.HOLD + 1])
    assert "".join(out) + stream.flush() == sp_tok.decode(ids)


# --- chat templates ----------------------------------------------------------------------------------------


def test_chatml_template(bpe_tok):
    assert bpe_tok.chat_template == CHATML_TEMPLATE
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert bpe_tok.apply_chat_template(messages) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert bpe_tok.apply_chat_template(messages, add_generation_prompt=False) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"


def _with_template(tmp_path: Path, template: str, in_file: bool = False) -> Tokenizer:
    folder = _folder(tmp_path, sp_vocab_metadata(), name="templated")
    if in_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_folder(folder)


def test_template_globals_and_bos(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    tok = _with_template(tmp_path, template)
    prompt = tok.apply_chat_template([{"role": "user", "content": " Hello "}])
    assert prompt == "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt)
    assert ids[:2] == [2, 4] and ids.count(2) == 1  # the template's BOS, once
    with pytest.raises(QinferError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_generation_marks_render_as_transformers_does(tmp_path):
    # {% generation %} marks the assistant's text for fine-tuning's loss mask; rendering keeps the body
    from transformers import AutoTokenizer

    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% generation %}{{ m['content'] }}"
                "{% endgeneration %}{% else %}U: {{ m['content'] }}{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}A:{% endif %}")
    tok = _with_template(tmp_path, template)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    ours = tok.apply_chat_template(messages)
    assert ours == "U: HiA: HelloU: ByeA:"  # trim_blocks takes the newline after a block tag
    theirs = AutoTokenizer.from_pretrained(tmp_path / "templated")
    assert ours == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_a_template_is_compiled_once_per_text(monkeypatch):
    compiled = []
    monkeypatch.setattr(tokenizer_module.ImmutableSandboxedEnvironment, "from_string",
                        lambda env, source: compiled.append(source) or source)
    tokenizer_module._compile_template.cache_clear()
    for source in ["{{ 1 }}", "{{ 1 }}", "{{ 2 }}", "{{ 1 }}"]:
        tokenizer_module._compile_template(source)
    assert compiled == ["{{ 1 }}", "{{ 2 }}"]


def test_template_tojson_and_jinja_file(tmp_path):
    tok = _with_template(tmp_path, "{{ messages[0] | tojson }}", in_file=True)
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}], add_generation_prompt=False) == (
        '{"role": "user", "content": "é<b>"}'
    )


def test_template_is_sandboxed(tmp_path):
    tok = _with_template(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(QinferError):
        tok.apply_chat_template([])


def test_no_template(sp_tok):
    assert sp_tok.chat_template is None
    with pytest.raises(QinferError, match="no chat template"):
        sp_tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(QinferError, match="neither tokenizer.json nor tokenizer.model"):
        Tokenizer.from_folder(tmp_path)


# --- the real Gemma 3 vocabulary (slow: reads a 250 MB GGUF) ------------------------------------------------


@pytest.mark.slow
def test_real_gemma3_vocabulary(tmp_path):
    from qinfer.sources.gguf_convert import open_gguf, read_metadata

    path = builtin_gguf("gemma-3-270m-q4_k_m.gguf")
    tok = Tokenizer.from_folder(_folder(tmp_path, read_metadata(open_gguf(path))))
    assert _pieces(tok, "Hello") == ["Hello"] and _pieces(tok, " Hello") == ["▁Hello"]
    assert _pieces(tok, "The capital of France is") == ["The", "▁capital", "▁of", "▁France", "▁is"]
    text = (
        "Paragraph one: naïve café, 日本語, emoji 🤖🚀, digits 3.14159 and 2024-05-01.\n\n"
        "    Indented   with   runs of spaces\tand\ttabs.\r\nLast line — “quoted” ‘text’ … ½ ∑."
    )
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<start_of_turn>user\n", add_bos=False)[0] == 105
    assert (tok.bos_id, tok.eos_ids) == (2, (1, 106))
