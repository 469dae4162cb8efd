"""Offline batch mode: many requests from a JSON-lines file run together on the engine, one result line each.

Each input line is a JSON object with ``prompt`` (text, continued as given) or ``messages`` (a chat, rendered
through the model's chat template), and any of the sampling fields ``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop`` (a string or a list of them) and ``stop_token_ids``; missing fields take the
command's options. Every line is read and checked before the first request runs, so a bad line is named and
nothing is half done. Results come out in input order, each as soon as it and the ones before it have ended.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from qinfer.engine.engine import Engine, Output
from qinfer.engine.sampling import SamplingParams
from qinfer.errors import QinferError
from qinfer.sources.tokenizer import Tokenizer

SAMPLING_FIELDS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}
FIELDS = {"prompt", "messages", "stop", "stop_token_ids", *SAMPLING_FIELDS}


@dataclass
class BatchRequest:
    prompt_ids: list[int]
    params: SamplingParams
    context: list[int] | None  # ids its text continues (a prompt's last; none for a chat's answer)


def read_requests(path: str | Path, tokenizer: Tokenizer, defaults: SamplingParams) -> list[BatchRequest]:
    """Every request of a JSON-lines file (blank lines skipped), or a one-line refusal naming the bad line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise QinferError(f"--prompts {path}: cannot read it ({e.strerror if isinstance(e, OSError) else e})") \
            from None
    requests = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                requests.append(_request(line, tokenizer, defaults))
            except QinferError as e:
                raise QinferError(f"--prompts {path}, line {number}: {e}") from None
    if not requests:
        raise QinferError(f"--prompts {path}: no requests in it (one JSON object per line)")
    return requests


def _request(line: str, tokenizer: Tokenizer, defaults: SamplingParams) -> BatchRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise QinferError(f"not JSON ({e.msg})") from None
    if not isinstance(item, dict):
        raise QinferError("not a JSON object")
    unknown = sorted(set(item) - FIELDS)
    if unknown:
        raise QinferError(f"unknown field {unknown[0]!r}; the fields are {', '.join(sorted(FIELDS))}")
    if ("prompt" in item) == ("messages" in item):
        raise QinferError('give one of "prompt" (text) or "messages" (a chat)')
    fields = {}
    for name, kind in SAMPLING_FIELDS.items():
        if name in item:
            value = item[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise QinferError(f'"{name}" must be {"an integer" if kind is int else "a number"} (got {value!r})')
            fields[name] = kind(value)
    stop = item.get("stop", list(defaults.stop))
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise QinferError('"stop" must be a string or a list of strings')
    stop_ids = item.get("stop_token_ids", list(defaults.stop_ids))
    if not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
        raise QinferError('"stop_token_ids" must be a list of integers')
    params = replace(defaults, **fields, stop=tuple(stop), stop_ids=tuple(stop_ids))  # checks the values
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise QinferError('"prompt" must be a string')
        ids = tokenizer.encode(item["prompt"])
        return BatchRequest(ids, params, ids[-1:])
    messages = item["messages"]
    if not tokenizer.chat_template:
        raise QinferError('this model has no chat template (a base model?): give "prompt" instead of "messages"')
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise QinferError('"messages" must be a non-empty list of {"role": ..., "content": ...} with string values')
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return BatchRequest(tokenizer.encode(text, add_bos=False), params, [])


def run_requests(engine: Engine, requests: list[BatchRequest], on_end=lambda output: None) -> Iterator[dict]:
    """Run ``requests`` together; their results (see :func:`result`) in input order. ``on_end`` is called with
    each request's last output as it ends."""
    for i, r in enumerate(requests):
        engine.add(str(i), r.prompt_ids, r.params, context=r.context)
    texts: dict[int, list[str]] = {i: [] for i in range(len(requests))}
    ended: dict[int, Output] = {}
    written = 0
    while engine.has_work():
        for out in engine.step():
            texts[int(out.id)].append(out.text)
            if out.finished:
                ended[int(out.id)] = out
                on_end(out)
        while written in ended:
            yield result(ended.pop(written), "".join(texts.pop(written)), written)
            written += 1


def result(last: Output, text: str, index: int) -> dict:
    """One request's result line: its text, token counts, why it ended, and its timings in seconds."""
    t = last.timings
    return {"index": index, "text": text, "finish_reason": last.finish_reason, "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens,
            "ttft_s": None if t.ttft is None else round(t.ttft, 4),
            "tpot_s": None if t.tpot is None else round(t.tpot, 4)}
