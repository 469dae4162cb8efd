"""A terminal chat: the conversation is re-rendered through the model's chat template every turn.

Ctrl-C while the model is answering stops that answer (the partial answer stays in the history);
Ctrl-C at the prompt clears the line; ``/reset`` forgets the conversation; ``/exit`` or EOF quits.
"""

import importlib
import sys
from collections.abc import Iterator

from qinfer.errors import QinferError
from qinfer.engine.engine import Engine, EngineConfig
from qinfer.engine.generate import GenerationStats, compile_failure_note, generate, kv_memory_for
from qinfer.engine.sampling import ContextFull, SamplingParams
from qinfer.model.decoder import Transformer
from qinfer.sources.tokenizer import StreamDecoder, Tokenizer

# What the chat's commands and keys do (one line; /help shows it again).
COMMANDS = "/reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply, /help shows this"


class TurnRefused(QinferError):
    """A turn the chat cannot take (text its tokenizer or template refuses): said, and the chat goes on without
    it. Any other error ends the chat, as it ends every command."""


class ChatSession:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, params: SamplingParams, system: str | None = None,
                 compiled: bool = False, kv_dtype: str = "bf16"):
        if not tokenizer.chat_template:
            raise QinferError("this model has no chat template (a base model?): use `qinfer generate` instead")
        context = model.config.max_position_embeddings
        if params.max_tokens >= context:  # no turn could run
            raise QinferError(f"--max-tokens {params.max_tokens} leaves no room for a prompt in the model's context "
                              f"of {context} tokens: lower --max-tokens")
        hello = [{"role": "user", "content": "Hello."}]
        try:  # a template or tokenizer that fails on a plain first turn would fail every turn: refuse it now
            first = len(encode_chat(tokenizer, hello))
        except QinferError as e:
            raise QinferError(f"this model cannot take a first chat turn: {e}") from None
        if system is not None:  # likewise a template that takes no system message ("" is a message too)
            try:
                tokenizer.encode(system, add_bos=False)
            except QinferError as e:
                raise QinferError(f"--system: {e}") from None
            try:
                first = len(encode_chat(tokenizer, [{"role": "system", "content": system}, *hello]))
            except QinferError as e:
                raise QinferError(f"--system: {e}; this model's template may take no system message: drop --system") \
                    from None
        if first + params.max_tokens > context:  # nor could a one-word turn
            took = "the template, --system and a word take" if system is not None else "the template and a word take"
            fix = "shorten --system or lower --max-tokens" if system is not None else "lower --max-tokens"
            raise QinferError(f"--max-tokens {params.max_tokens} leaves no room for a first turn: {took} {first} "
                              f"tokens of the model's context of {context}: {fix}")
        self.model, self.tokenizer, self.params, self.system = model, tokenizer, params, system
        self.compiled = compiled  # decode through torch.compile (qinfer.engine.generate.generate)
        self.kv_dtype = kv_dtype
        # one engine for the session: each turn's prompt starts with the conversation so far, whose full blocks
        # the prefix cache still holds, so a turn computes only what is new (blocks for the whole context, or
        # the engine's default memory if that is less)
        self.engine = None if compiled else Engine(model, config=EngineConfig(kv_dtype=kv_dtype, kv_memory=min(
            EngineConfig.kv_memory, kv_memory_for(model, context, kv_dtype))), eos_ids=())
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    @property
    def has_history(self) -> bool:
        return len(self.messages) > (self.system is not None)

    def reply(self, text: str, stats: GenerationStats | None = None) -> Iterator[str]:
        """Stream the assistant's answer to ``text`` as text pieces; the answer joins the history. A turn that
        cannot be taken raises :class:`TurnRefused` (or ``ContextFull``) before any piece; other errors (the
        machine's, mid-answer) are the session's end."""
        try:
            self.tokenizer.encode(text, add_bos=False)  # text the tokenizer refuses is named as typed
        except QinferError as e:
            raise TurnRefused(str(e)) from None
        self.messages.append({"role": "user", "content": text})
        try:
            ids = encode_chat(self.tokenizer, self.messages)
            tokens = generate(self.model, ids, self.params, stop_ids=self.tokenizer.eos_ids, stats=stats,
                              compiled=self.compiled, kv_dtype=self.kv_dtype, engine=self.engine)
        except BaseException as e:  # the template refused the turn, the conversation no longer fits, or Ctrl-C
            self.messages.pop()  # before the answer began: the turn is not kept (nor two user turns in a row)
            if not isinstance(e, QinferError) or isinstance(e, ContextFull):
                raise
            raise TurnRefused(str(e)) from None
        stream = StreamDecoder(self.tokenizer)
        answer = []
        try:
            for token in tokens:
                piece = stream.feed(token)
                answer.append(piece)
                yield piece
            answer.append(stream.flush())
            yield answer[-1]
        finally:  # also on Ctrl-C: keep what was said so far
            self.messages.append({"role": "assistant", "content": "".join(answer)})


def encode_chat(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids of ``messages`` and the assistant's turn to answer."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(prompt, add_bos=False)  # templates write their own BOS where they want one


def _read_line(stdin, stdout, terminal: bool) -> str:
    """One line typed ("" at EOF). At a terminal through ``input``, which line-edits (arrows, history) once
    ``readline`` is loaded; from a pipe as it comes."""
    if terminal:
        try:
            return input(">>> ") + "\n"
        except EOFError:
            return ""
    if stdin.isatty():
        stdout.write(">>> ")
        stdout.flush()
    return stdin.readline()


def repl(session: ChatSession, stdin=None, stdout=None) -> None:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    interactive = stdin.isatty()
    # input() line-edits only on the process's own terminal
    terminal = interactive and stdin is sys.stdin and stdout is sys.stdout and sys.stdout.isatty()
    if terminal:
        try:
            importlib.import_module("readline")  # loading it gives input() line editing and history
        except ImportError:  # not on every platform: input() still works, unedited
            pass
    if hasattr(stdin, "reconfigure"):  # bytes that are not UTF-8 reach the tokenizer, which names them
        stdin.reconfigure(errors="surrogateescape")
    noted = False  # the note that --compile failed, written once
    if interactive:
        stdout.write(f"qinfer chat: {COMMANDS}\n")
    while True:
        try:
            line = _read_line(stdin, stdout, terminal)
        except KeyboardInterrupt:
            stdout.write("\n")
            continue
        if not line:  # EOF
            if interactive:
                stdout.write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return
        if text == "/reset":
            session.reset()
            stdout.write("(conversation cleared)\n")
            continue
        if text in ("/help", "/?"):
            stdout.write(f"({COMMANDS})\n")
            continue
        if text.startswith("/") and len(text.split()) == 1:  # a mistyped command is not sent as a turn
            stdout.write(f"(unknown command {text}: {COMMANDS})\n")
            continue
        try:
            for piece in session.reply(text):
                stdout.write(piece)
                stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        except (TurnRefused, ContextFull) as e:  # this turn cannot run: say so, keep the session (without it)
            hint = "; /reset clears the conversation" if isinstance(e, ContextFull) and session.has_history else ""
            stdout.write(f"({e}{hint})")
        except BaseException:  # the chat ends: the answer's line first, then the error's
            stdout.write("\n")
            stdout.flush()
            raise
        stdout.write("\n")
        stdout.flush()
        if session.compiled and compile_failure_note() and not noted:
            sys.stderr.write(compile_failure_note() + "\n")
            noted = True
