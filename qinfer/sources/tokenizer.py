"""Our tokenizer: one interface over an HF folder's tokenizer files, whichever library they need.

    tok = Tokenizer.from_folder(folder)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    stream = StreamDecoder(tok)
    for i in generated: print(stream.feed(i), end="")
    print(stream.flush())

Backends: ``tokenizer.json`` → the ``tokenizers`` library (what user HF folders ship); else ``tokenizer.model`` →
``sentencepiece`` (what our GGUF conversion writes for SentencePiece vocabularies, see ``qinfer.sources.gguf_vocab``).
Settings come from ``tokenizer_config.json`` (``add_bos_token``, ``bos_token``, ``eos_token``,
``chat_template``), ``chat_template.jinja``, and the stop ids from ``generation_config.json``/``config.json``.

BOS rule: ``encode(text, add_bos=True)`` starts with exactly one BOS when the model uses one — whether the
BOS comes from the tokenizer's post-processor, from us, or from the text itself (chat templates often write
``{{ bos_token }}``). ``add_bos=False`` adds none.
"""

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from sentencepiece import SentencePieceProcessor
from tokenizers import Tokenizer as HFTokenizer

from qinfer.errors import QinferError
from qinfer.store.reading import read_json_object, read_text


class _Backend(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...


class _FastBackend:
    """``tokenizers`` over ``tokenizer.json``; its post-processor decides which special tokens wrap a text."""

    def __init__(self, tok: HFTokenizer):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_special):
        return self._tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids, skip_special):
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token):
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id):
        return self._tok.id_to_token(token_id)


class _SentencePieceBackend:
    """``sentencepiece`` over ``tokenizer.model``, plus special tokens written in the text.

    SentencePiece never matches control pieces (``<start_of_turn>``) in input text, but chat templates write
    them as text; like transformers we cut the text at every special token and encode the pieces between.
    """

    def __init__(self, sp: SentencePieceProcessor, extra_special: dict[str, int]):
        self._sp = sp
        self.vocab_size = sp.get_piece_size()
        self._special = {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i)}
        self._special.update(extra_special)
        self._special_ids = frozenset(self._special.values())
        # Longest first, so `<end_of_turn>` wins over any special token that is a prefix of it.
        alternatives = "|".join(re.escape(s) for s in sorted(self._special, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})") if alternatives else None

    def encode(self, text, add_special):
        # BOS is the wrapper's business for SentencePiece; `add_special` has nothing to add here.
        parts = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:  # re.split puts the captured separators at odd positions
                ids.append(self._special[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids, skip_special):
        # Ids past the pieces (a config.json vocab_size padded past the tokenizer's, as Gemma 3 4B's) decode to
        # nothing, as in the `tokenizers` backend and transformers; sentencepiece would raise on them.
        ids = [i for i in map(int, ids) if 0 <= i < self.vocab_size]
        if skip_special:
            return self._sp.decode([i for i in ids if i not in self._special_ids])
        # SentencePiece renders control pieces as "", so decode the runs between them and spell them out.
        out, run = [], []
        for i in ids:
            if i in self._special_ids:
                out += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(out) + self._sp.decode(run)

    def token_to_id(self, token):
        if token in self._special:
            return self._special[token]
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, token_id):
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None


def _check_utf8(text: str) -> None:
    """Refuse text holding bytes that were not UTF-8 (Python keeps them from argv and stdin as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(e.object[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
        raise QinferError(f"the text is not valid UTF-8 ({what} at character {e.start}): give UTF-8 text") from None


def _parsed(file: Path, parse):
    """``parse(the bytes of file)``, or one line naming a tokenizer file its library cannot read. The libraries
    are handed bytes, not a path: they take only UTF-8 paths, and a folder's name may be any bytes."""
    try:
        data = file.read_bytes()
    except OSError as e:
        raise QinferError(f"cannot read {file}: {e.strerror or e}; check the file's permissions, or copy the "
                          "model's tokenizer files again") from None
    try:
        return parse(data)
    except Exception as e:  # the tokenizers and sentencepiece libraries raise plain Exception / RuntimeError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QinferError(f"{file} is not a tokenizer file its library can read ({reason}): copy the model's "
                          "tokenizer files again") from None


class Tokenizer:
    """Text ↔ token ids for one model folder, its special tokens and its chat template."""

    def __init__(
        self,
        backend: _Backend,
        bos_id: int | None,
        eos_ids: tuple[int, ...],
        add_bos_token: bool | None,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        model_vocab_size: int | None = None,
    ):
        self._backend = backend
        self.model_vocab_size = model_vocab_size  # config.json's vocab_size: ids at or past it have no embedding
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        # None: the tokenizer.json post-processor decides; True/False: tokenizer_config.json decides.
        self.add_bos_token = add_bos_token
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, path: Path) -> "Tokenizer":
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        if (path / "tokenizer.json").is_file():
            fast = _parsed(path / "tokenizer.json", lambda data: HFTokenizer.from_str(data.decode()))
            backend: _Backend = _FastBackend(fast)
            add_bos_token = config.get("add_bos_token")
        elif (path / "tokenizer.model").is_file():
            sp = _parsed(path / "tokenizer.model", lambda data: SentencePieceProcessor(model_proto=data))
            extra = {
                _token_text(t): int(i)
                for i, t in config.get("added_tokens_decoder", {}).items()
                if isinstance(t, dict) and t.get("special") and int(i) < sp.get_piece_size()
            }
            backend = _SentencePieceBackend(sp, extra)
            # transformers' SentencePiece tokenizers (Llama, Gemma) add BOS unless told otherwise.
            add_bos_token = config.get("add_bos_token", True)
        else:
            raise QinferError(f"{path} has neither tokenizer.json nor tokenizer.model; it is not a complete model folder")

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():  # newer transformers save the template beside the config
            template = read_text(path / "chat_template.jinja", _FOLDER_FIX)

        generation, model_config = _read_json(path / "generation_config.json"), _read_json(path / "config.json")
        bos_token, eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        # The tokenizer's own BOS first, as transformers' tokenizers add it; the configs' id where it names none.
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        if bos_id is None:
            bos_id = generation.get("bos_token_id", model_config.get("bos_token_id"))
        eos_ids: list[int] = []
        for source in (generation.get("eos_token_id"), model_config.get("eos_token_id"),
                       backend.token_to_id(eos_token) if eos_token else None):
            for i in source if isinstance(source, list) else [source]:
                if i is not None and not isinstance(i, int):
                    raise QinferError(f"{path}: eos_token_id {source!r} is not a token id or a list of them; fix "
                                      "it in config.json or generation_config.json")
                if i is not None and i not in eos_ids:
                    eos_ids.append(i)
        if bos_token is None and bos_id is not None:
            bos_token = backend.id_to_token(bos_id)
        if eos_token is None and eos_ids:
            eos_token = backend.id_to_token(eos_ids[0])
        vocab = (model_config.get("text_config") or model_config).get("vocab_size")
        model_vocab = int(vocab) if isinstance(vocab, int) else None
        # Padding rows (Gemma 3 4B: 64, Qwen2.5: 271) and an extra image token are normal; a factor of two is
        # another model's tokenizer, which would otherwise generate tokens that decode to nothing.
        if model_vocab and not model_vocab / 2 <= backend.vocab_size <= 2 * model_vocab:
            raise QinferError(
                f"{path}'s tokenizer has {backend.vocab_size} tokens but config.json vocab_size is {model_vocab}: "
                "the tokenizer files are not this model's; copy the model's own"
            )
        return cls(backend, bos_id, tuple(eos_ids), add_bos_token, bos_token, eos_token, template, model_vocab)

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def leading_bos(self) -> int | None:
        """The BOS id ``encode(text)`` starts text with, or None when this tokenizer puts none in front of text
        (SmolLM2 and Qwen set ``add_bos_token`` false or leave it to a post-processor that adds none, though
        their configs name a BOS id)."""
        if self.bos_id is None:
            return None
        return self.bos_id if self.encode("a")[:1] == [self.bos_id] else None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_bos`` it starts with one BOS if the model uses BOS (see module doc)."""
        _check_utf8(text)
        ids = self._backend.encode(text, add_special=add_bos and self.add_bos_token is not False)
        bos = self.bos_id
        if add_bos and bos is not None:
            if self.add_bos_token and ids[:1] != [bos]:
                ids = [bos] + ids
            while ids[:2] == [bos, bos]:  # post-processor BOS + a BOS written in the text
                ids = ids[1:]
        # A tokenizer may list a few more tokens than the model has rows (Gemma 3's image token): refuse only
        # an id that is actually produced.
        if self.model_vocab_size is not None and ids and max(ids) >= self.model_vocab_size:
            i = max(ids)
            raise QinferError(
                f"the tokenizer gave token {self._backend.id_to_token(i)!r} id {i}, but the model has "
                f"{self.model_vocab_size} tokens (config.json vocab_size): the folder's tokenizer files are not "
                "this model's; copy the model's own"
            )
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` as transformers does: sandboxed jinja, trim/lstrip blocks, same globals."""
        if self.chat_template is None:
            raise QinferError("this model has no chat template; use a plain prompt or an instruction-tuned model")
        try:
            template = _compile_template(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise QinferError(f"the chat template failed on these messages: {e}") from e


class StreamDecoder:
    """Incremental decoding for streaming: ``feed`` one id, get back only the newly completed text.

    Decoding ids one at a time is wrong twice over: a character split over byte-fallback/byte-level tokens
    decodes to U+FFFD until its last byte arrives, and SentencePiece drops the leading space of the first
    piece it decodes. So we decode a window that starts one emitted step back (context for the space) and
    hold back the U+FFFD that end it while they may be an incomplete character; the text before them goes out
    at once. The concatenated output equals ``decode(all_ids)`` once ``flush`` is called, unless a character
    is still incomplete after ``HOLD`` tokens (bytes that are no UTF-8: a tiny or broken model's), where the
    window is closed as it stands so that decoding never grows with the length of such a run. ``context``, ids
    already shown (a prompt's last token), is the first window's start, so a continuation's first piece keeps its
    leading space.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in context]
        self._prefix = 0  # window start: the previous emit point
        self._read = len(self._ids)  # ids up to here are emitted
        self._sent = 0  # characters of the ids past _read already returned (all but a held U+FFFD run)

    HOLD = 8  # tokens a U+FFFD run may wait to become a character (UTF-8's longest is 4 bytes)

    def _pending(self) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        return self._tok.decode(self._ids[self._prefix :], self._skip)[len(done) :]

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._pending()
        if not text:  # (a skipped special token: the window keeps its start, the context of what follows)
            return ""
        if text.endswith("\ufffd") and len(self._ids) - self._read < self.HOLD:
            stable = text.rstrip("\ufffd")  # what comes before an unfinished character does not change
            new, self._sent = stable[self._sent :], max(self._sent, len(stable))
            return new
        new = text[self._sent :]
        self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        return new

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character comes out as U+FFFD, as ``decode`` gives it)."""
        text = self._pending()[self._sent :]
        self._prefix = self._read = len(self._ids)
        self._sent = 0
        return text


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: unlike jinja's, it does not HTML-escape, so templates render JSON verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the marks fine-tuning templates put around the assistant's
    text (for a loss mask). As in transformers when no mask is asked for, the block renders as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=8)  # a chat compiles its template once, not every turn
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(token: Any) -> str | None:
    """``tokenizer_config.json`` writes a token as a string or as an AddedToken dict with ``content``."""
    return token.get("content") if isinstance(token, dict) else token


_FOLDER_FIX = "fix or re-create the model folder"


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, _FOLDER_FIX) if path.is_file() else {}
