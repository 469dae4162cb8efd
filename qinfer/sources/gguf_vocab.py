"""Tokenizer files from a GGUF's vocabulary: the tokenizer half of GGUF → HF-folder conversion.

A GGUF carries no tokenizer file, only llama.cpp's description of one (``tokenizer.ggml.*``). We rebuild
the file the model was trained with, because every token id the model sees must match:

* ``tokenizer.ggml.model == "llama"`` (SentencePiece: Llama 2, Gemma, Mistral) → ``tokenizer.model``, a
  SentencePiece ``ModelProto`` built piece by piece. transformers' own GGUF path turns this into a
  ``tokenizers`` BPE with merges re-derived from scores, which has gone wrong for Gemma; a proto with the
  file's pieces, scores and types is what SentencePiece itself would have loaded.
* ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE with merges: SmolLM, Qwen, Llama 3) → ``tokenizer.json``
  built with the ``tokenizers`` library; the pre-tokenizer comes from ``tokenizer.ggml.pre``.

Special token ids are resolved by their text where the vocabulary has it (see ``resolve_special_tokens``):
a GGUF's ``bos``/``eos`` ids are written by whatever converter produced the file and are not always right.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from qinfer.errors import QinferError

# llama.cpp's token types (gguf.TokenType). SentencePiece's piece types use the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Markers that end a chat turn. A model that has one stops there as well as at its eos: Gemma's eos is
# `<eos>` but its chat turns end with `<end_of_turn>`.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")


def _gpt2_split():
    # ByteLevel(use_regex=True) applies GPT-2's split: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre → the pre-tokenizer the merges were learned under (names as in llama.cpp's llama-vocab.cpp).
# Extend with pre_tokenizers.Sequence([Split(Regex(<the model's regex>), "isolated"), ByteLevel(use_regex=False)]).
BPE_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    # SmolLM: every digit on its own, then the GPT-2 split (its tokenizer.json has exactly this sequence,
    # llama.cpp's "smollm" regexes are \p{N} then GPT-2's).
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()]),
}


@dataclass(frozen=True)
class GGUFVocab:
    """The ``tokenizer.ggml.*`` metadata of one GGUF, as read (ids not yet checked against the text)."""

    model: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    scores: tuple[float, ...] | None
    merges: tuple[str, ...] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def __post_init__(self):
        n = len(self.tokens)
        if n == 0:
            raise QinferError("the GGUF has no tokenizer.ggml.tokens; re-export it with llama.cpp's converter")
        if len(self.token_types) != n or (self.scores is not None and len(self.scores) != n):
            raise QinferError("the GGUF's tokenizer arrays differ in length; the file is corrupt, download it again")
        if self.model not in ("llama", "gpt2"):
            raise QinferError(
                f"unsupported tokenizer.ggml.model {self.model!r}; supported: 'llama' (SentencePiece), 'gpt2' (BPE)"
            )

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "GGUFVocab":
        def get(key, default=None):
            return meta.get(f"tokenizer.{key}", default)

        tokens = tuple(get("ggml.tokens", ()))
        model = get("ggml.model", "llama")
        scores, merges = get("ggml.scores"), get("ggml.merges")
        return cls(
            model=model,
            pre=get("ggml.pre"),
            tokens=tokens,
            token_types=tuple(int(t) for t in get("ggml.token_type", [NORMAL] * len(tokens))),
            scores=None if scores is None else tuple(float(s) for s in scores),
            merges=None if merges is None else tuple(merges),
            bos_id=get("ggml.bos_token_id"),
            eos_id=get("ggml.eos_token_id"),
            unk_id=get("ggml.unknown_token_id"),
            pad_id=get("ggml.padding_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise, and a
            # dummy-prefix space likewise; for BPE both default off.
            add_bos=bool(get("ggml.add_bos_token", model == "llama")),
            add_eos=bool(get("ggml.add_eos_token", False)),
            add_space_prefix=bool(get("ggml.add_space_prefix", model == "llama")),
            chat_template=get("chat_template"),
        )


@dataclass(frozen=True)
class SpecialTokens:
    """Resolved special token ids. ``stop_ids`` starts with ``eos_id`` and adds end-of-turn markers."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    stop_ids: tuple[int, ...]


def resolve_special_tokens(vocab: GGUFVocab) -> SpecialTokens:
    """Trust a control token named ``<bos>``/``<eos>`` over the GGUF's id fields.

    Some Gemma GGUFs claim bos == eos == 1; the vocabulary itself says ``<eos>`` is 1 and ``<bos>`` is 2,
    and a model fed its eos where it expects bos produces garbage without any error.
    """
    control = {tok: i for i, (tok, kind) in enumerate(zip(vocab.tokens, vocab.token_types)) if kind == CONTROL}
    n = len(vocab.tokens)

    def valid(i):
        return i if i is not None and 0 <= i < n else None

    bos = control.get("<bos>", valid(vocab.bos_id))
    eos = control.get("<eos>", valid(vocab.eos_id))
    unk = valid(vocab.unk_id)
    if unk is None:
        unk = next((i for i, kind in enumerate(vocab.token_types) if kind == UNKNOWN), None)
    stops = [eos] if eos is not None else []
    stops += [control[t] for t in END_OF_TURN_TOKENS if t in control and control[t] not in stops]
    return SpecialTokens(bos_id=bos, eos_id=eos, pad_id=valid(vocab.pad_id), unk_id=unk, stop_ids=tuple(stops))


def sentencepiece_proto(vocab: GGUFVocab, specials: SpecialTokens) -> sp_pb2.ModelProto:
    """The SentencePiece model a ``llama``-type GGUF vocabulary came from.

    BPE like Llama's and Gemma's own ``tokenizer.model`` (SentencePiece BPE merges by piece score, so the
    scores are the merge order), byte fallback when the vocabulary has ``<0xNN>`` pieces, identity
    normalization that keeps every space (``remove_extra_whitespaces`` off), and a dummy-prefix space only
    when the GGUF asks for one — Gemma does not: "Hello" → ['Hello'], " Hello" → ['▁Hello'].
    """
    if vocab.scores is None:
        raise QinferError("the GGUF's SentencePiece vocabulary has no tokenizer.ggml.scores; re-export the file")
    proto = sp_pb2.ModelProto()
    seen = set()
    for token, kind, score in zip(vocab.tokens, vocab.token_types, vocab.scores):
        kind = kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
        if kind == USER_DEFINED:
            # llama.cpp writes user-defined pieces with real spaces ("  "); SentencePiece matches them
            # against normalized text, where spaces are already "▁".
            token = token.replace(" ", "▁")
        if token in seen or not token:
            raise QinferError(f"the GGUF vocabulary has an empty or repeated piece {token!r}; it cannot be loaded")
        seen.add(token)
        proto.pieces.add(piece=token, score=score, type=kind)
    if all(t == NORMAL for t in vocab.token_types):  # no tokenizer.ggml.token_type (optional, as in llama.cpp)
        for p in proto.pieces:
            if len(p.piece) == 6 and p.piece.startswith("<0x") and p.piece.endswith(">"):
                p.type = BYTE  # llama.cpp finds byte pieces by their text
        for i in (specials.bos_id, specials.eos_id, specials.pad_id):
            if i is not None:
                proto.pieces[i].type = CONTROL
    if specials.unk_id is not None:
        proto.pieces[specials.unk_id].type = UNKNOWN  # SentencePiece loads no model whose unk piece is not

    def piece(i, default):
        return vocab.tokens[i] if i is not None else default

    spec = proto.trainer_spec
    spec.model_type = sp_pb2.TrainerSpec.BPE
    spec.vocab_size = len(vocab.tokens)
    spec.byte_fallback = any(p.type == BYTE for p in proto.pieces)
    spec.split_digits = True
    spec.allow_whitespace_only_pieces = True
    spec.unk_id = specials.unk_id if specials.unk_id is not None else -1
    spec.bos_id = specials.bos_id if specials.bos_id is not None else -1
    spec.eos_id = specials.eos_id if specials.eos_id is not None else -1
    spec.pad_id = specials.pad_id if specials.pad_id is not None else -1
    spec.unk_piece = piece(specials.unk_id, "<unk>")
    spec.bos_piece = piece(specials.bos_id, "<s>")
    spec.eos_piece = piece(specials.eos_id, "</s>")
    spec.pad_piece = piece(specials.pad_id, "<pad>")

    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = vocab.add_space_prefix
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return proto


def bpe_tokenizer(vocab: GGUFVocab, specials: SpecialTokens) -> HFTokenizer:
    """A ``tokenizers`` byte-level BPE from a ``gpt2``-type GGUF vocabulary and its merges."""
    if vocab.merges is None:
        raise QinferError("the GGUF's BPE vocabulary has no tokenizer.ggml.merges; re-export the file")
    pre = vocab.pre or "default"
    if pre not in BPE_PRE_TOKENIZERS:
        raise QinferError(
            f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))} "
            "(add its split to qinfer.sources.gguf_vocab.BPE_PRE_TOKENIZERS)"
        )
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bad = next((m for m, pair in zip(vocab.merges, merges) if len(pair) != 2 or not all(t in ids for t in pair)), None)
    if bad is not None:
        raise QinferError(f"the GGUF's tokenizer.ggml.merges has {bad!r}, not two tokens of its vocabulary; "
                          "the file is corrupt: download or re-export it")
    tok = HFTokenizer(models.BPE(vocab=ids, merges=merges, byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = BPE_PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    # Ids are taken from the vocabulary (the tokens are already in it), so adding keeps every id.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(vocab.tokens, vocab.token_types) if k == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(vocab.tokens, vocab.token_types) if k == USER_DEFINED]
    )
    # BOS/EOS come from the post-processor, as in the tokenizer.json files models ship with.
    prefix = [vocab.tokens[specials.bos_id]] if vocab.add_bos and specials.bos_id is not None else []
    suffix = [vocab.tokens[specials.eos_id]] if vocab.add_eos and specials.eos_id is not None else []
    if prefix or suffix:
        single = " ".join(prefix + ["$A"] + suffix)
        pair = " ".join(prefix + ["$A"] + suffix + prefix + ["$B:1"] + suffix)
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, ids[t]) for t in dict.fromkeys(prefix + suffix)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(vocab: GGUFVocab, specials: SpecialTokens) -> dict[str, Any]:
    """``tokenizer_config.json``: what both ``qinfer.sources.tokenizer`` and transformers read beside the tokenizer."""

    def text(i):
        return vocab.tokens[i] if i is not None else None

    # transformers picks its SentencePiece conversion by class: Llama's adds the dummy-prefix space, Gemma's not.
    if vocab.model == "gpt2":
        tokenizer_class = "PreTrainedTokenizerFast"  # tokenizer.json as written, no class-specific rebuild
    else:
        tokenizer_class = "LlamaTokenizer" if vocab.add_space_prefix else "GemmaTokenizer"
    config = {
        "tokenizer_class": tokenizer_class,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "bos_token": text(specials.bos_id),
        "eos_token": text(specials.eos_id),
        "pad_token": text(specials.pad_id),
        "unk_token": text(specials.unk_id),
        "clean_up_tokenization_spaces": False,
    }
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    return config


def write_tokenizer_files(vocab: GGUFVocab, specials: SpecialTokens, out_dir: Path) -> None:
    """Write ``tokenizer.model`` (SentencePiece) or ``tokenizer.json`` (BPE), and ``tokenizer_config.json``."""
    out_dir = Path(out_dir)
    if vocab.model == "llama":
        (out_dir / "tokenizer.model").write_bytes(sentencepiece_proto(vocab, specials).SerializeToString())
    else:
        bpe_tokenizer(vocab, specials).save(str(out_dir / "tokenizer.json"))
    config = {k: v for k, v in tokenizer_config(vocab, specials).items() if v is not None}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
