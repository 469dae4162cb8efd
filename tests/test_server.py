"""``qinfer serve`` run for real on a tiny model: the official openai client (chat and completions, streamed or
not) against the library's own output, bad requests, disconnects, 32 concurrent clients, the queue limit, the API
key, SIGTERM."""

import asyncio
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import openai
import pytest
import torch

from qinfer.engine.chat import encode_chat
from qinfer.engine.engine import Engine, EngineConfig
from qinfer.engine.sampling import SamplingParams
from qinfer.model.loader import load_model
from qinfer.sources.tokenizer import Tokenizer
from tests.serving import ROOT, serve, tiny_chat_model

NAME = "tiny"
CONTEXT = 4096  # long enough for a reply to be stopped midway


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("served") / NAME, context=CONTEXT)


@pytest.fixture(scope="module")
def server(folder):
    with serve(folder, "--dtype", "fp32", "--kv-memory", "64MiB") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def library(folder):
    """What the library itself answers, alone: (prompt ids, sampling, context) -> (text, finish reason)."""
    model = load_model(folder, dtype=torch.float32, run=True)
    tokenizer = Tokenizer.from_folder(folder)

    def answer(ids, params, context=None):
        engine = Engine(model, tokenizer, EngineConfig(kv_memory=64 << 20))
        engine.add("r", ids, params, context=context)
        outputs = []
        while engine.has_work():
            outputs += engine.step()
        return "".join(o.text for o in outputs), outputs[-1].finish_reason

    answer.tokenizer = tokenizer
    return answer


def chat_ids(tokenizer, messages):
    return encode_chat(tokenizer, messages)


def request(server, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
            connection: http.client.HTTPConnection | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one raw HTTP request."""
    url = urlparse(server.url)
    conn = connection or http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request(method, path, body=body.encode() if isinstance(body, str) else body,
                 headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    raw = response.read()
    if connection is None:
        conn.close()
    return response.status, dict(response.getheaders()), json.loads(raw) if raw else {}


def metrics(server) -> dict[str, float]:
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(predicate, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# --- the official client ---------------------------------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    assert request(server, "GET", "/health")[:1] == (200,)


def test_chat_completion_is_the_librarys_answer(client, library):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "It is a truth"}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    ids = chat_ids(library.tokenizer, messages)
    text, finish = library(ids, SamplingParams(max_tokens=12), context=[])
    choice = reply.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, finish)
    assert reply.object == "chat.completion" and reply.model == NAME
    assert reply.usage.prompt_tokens == len(ids)
    assert 1 <= reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_equals_the_whole_reply(client):
    messages = [{"role": "user", "content": "a single man in possession"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_text_and_token_ids_streamed_or_not(client, library):
    prompt = "However little known the feelings"
    ids = library.tokenizer.encode(prompt)
    text, finish = library(ids, SamplingParams(max_tokens=10), context=ids[-1:])
    for given in (prompt, ids, [prompt], [ids]):
        reply = client.completions.create(model=NAME, prompt=given, max_tokens=10, temperature=0)
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (text, finish)
        assert reply.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == text


def test_completions_default_to_16_tokens(client):
    # OpenAI's default max_tokens for completions: the reply ends at 16 tokens (or before, at end of sequence)
    reply = client.completions.create(model=NAME, prompt="the rightful property of some one", temperature=0)
    assert reply.usage.completion_tokens <= 16
    assert reply.choices[0].finish_reason == "length" or reply.usage.completion_tokens < 16


def test_a_stop_string_ends_the_text_before_it(client):
    prompt = "of their daughters"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"the greedy text {full!r} is too short to pick a stop string from"
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == full[:full.index(stop)]


def test_a_seed_gives_the_same_sample(client):
    def sample(seed):
        return client.completions.create(model=NAME, prompt="fortune", max_tokens=24, temperature=1.0,
                                         seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)  # 24 tokens drawn from 320 at temperature 1: never all the same


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client):
    messages = [{"role": "system", "content": "Answer in the manner of Jane Austen. " * 8},
                {"role": "user", "content": "Who is Mr Darcy?"}]
    before = metrics(server).get("qinfer_prefix_cache_hits_total", 0)
    first = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens >= 32
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16 and cached % 16 == 0  # every full block of the prompt
    assert second.choices[0].message.content == first.choices[0].message.content
    assert metrics(server)["qinfer_prefix_cache_hits_total"] >= before + 1


def test_32_concurrent_streaming_clients_each_get_their_own_answer(server, library):
    prompts = [f"{word} {n}" for n, word in enumerate(["truth", "fortune", "wife", "feelings"] * 8)]

    async def one(client, prompt):
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            usage = chunk.usage or usage
        return text, usage

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    for prompt, (text, usage) in zip(prompts, results):
        ids = library.tokenizer.encode(prompt)
        assert text == library(ids, SamplingParams(max_tokens=16), context=ids[-1:])[0], prompt
        assert usage.prompt_tokens == len(ids)
    assert wait_for(lambda: metrics(server)["qinfer_kv_blocks_used"] == 0)


# --- bad requests ----------------------------------------------------------------------------------------------

CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
BAD = [  # (path, body, status, param)
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", "", 400, None),
    ("/v1/chat/completions", b"\xff\xfe{}", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": CONTEXT}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {**CHAT, "seed": "x"}, 400, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, 400, "seed"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, 400, None),
    ("/v1/chat/completions", {**CHAT, "stop": ["a"] * 17}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": 3}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"model": NAME}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * (CONTEXT + 1)}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "temperature": None, "top_p": 1e-9, "max_tokens": "∞"}, 400, "max_tokens"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{n}" for n in range(len(BAD))])
def test_a_bad_request_is_a_4xx_with_an_openai_error_body(server, path, body, status, param):
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    got, headers, reply = request(server, "POST", path, raw)
    assert got == status, reply
    error = reply["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert error["param"] == param


def test_a_body_past_the_limit_is_refused_before_it_is_read(server):
    status, _, reply = request(server, "POST", "/v1/completions", b"x" * ((16 << 20) + 1))
    assert status == 413 and "limit" in reply["error"]["message"]


def test_the_prompt_past_the_context_is_named(server):
    _, _, reply = request(server, "POST", "/v1/completions", json.dumps({"prompt": [1] * (CONTEXT + 1)}))
    assert reply["error"]["code"] == "context_length_exceeded"
    assert f"context of {CONTEXT} tokens" in reply["error"]["message"]


def test_routes_and_methods_that_do_not_exist(server):
    assert request(server, "GET", "/v1/nothing")[0] == 404
    status, _, reply = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and reply["error"]["message"]
    assert request(server, "GET", "/v1/models/gpt-4")[0] == 404


def test_the_server_is_healthy_after_a_thousand_bad_requests(server, client):
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    statuses = set()
    for n in range(1000):
        path, body, _, _ = BAD[n % len(BAD)]
        raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
        statuses.add(request(server, "POST", path, raw, connection=conn)[0])
    conn.close()
    assert statuses <= {400, 404}
    assert request(server, "GET", "/health")[0] == 200
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    assert metrics(server)["qinfer_kv_blocks_used"] == 0


# --- disconnects -----------------------------------------------------------------------------------------------

def _aborted(server) -> float:
    return metrics(server).get('qinfer_requests_total{finish_reason="abort"}', 0)


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    before = _aborted(server)
    url = urlparse(server.url)
    body = json.dumps({"prompt": "truth", "max_tokens": CONTEXT - 64, "temperature": 0, "stream": True})
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    received = b""
    while received.count(b"data: ") < 3:  # the reply is streaming
        received += sock.recv(65536)
    assert metrics(server)["qinfer_kv_blocks_used"] > 0
    sock.close()
    assert wait_for(lambda: _aborted(server) == before + 1)
    assert wait_for(lambda: metrics(server)["qinfer_kv_blocks_used"] == 0)


def test_a_client_that_disconnects_while_waiting_for_a_whole_reply_aborts_it(server):
    before = _aborted(server)
    url = urlparse(server.url)
    body = json.dumps({"prompt": "truth", "max_tokens": CONTEXT - 64, "temperature": 0})
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    assert wait_for(lambda: metrics(server)["qinfer_kv_blocks_used"] > 0)
    sock.close()
    assert wait_for(lambda: _aborted(server) == before + 1)
    assert wait_for(lambda: metrics(server)["qinfer_kv_blocks_used"] == 0)


def test_metrics_count_tokens_and_requests(server, client):
    before = metrics(server)
    reply = client.completions.create(model=NAME, prompt="a good fortune", max_tokens=5, temperature=0)
    after = metrics(server)
    assert after["qinfer_prompt_tokens_total"] - before["qinfer_prompt_tokens_total"] == reply.usage.prompt_tokens
    assert after["qinfer_generation_tokens_total"] - before["qinfer_generation_tokens_total"] == \
        reply.usage.completion_tokens
    assert after["qinfer_time_to_first_token_seconds_count"] == before["qinfer_time_to_first_token_seconds_count"] + 1
    assert after["qinfer_kv_blocks_used"] + after["qinfer_kv_blocks_free"] == after["qinfer_kv_blocks"]
    assert after["qinfer_requests_running"] == 0 and after["qinfer_requests_waiting"] == 0


# --- servers of their own --------------------------------------------------------------------------------------

def test_an_api_key_is_required_when_set(folder):
    with serve(folder, "--dtype", "fp32", "--kv-memory", "16MiB", "--api-key", "s3cret") as s:
        assert request(s, "GET", "/v1/models")[0] == 401
        status, headers, reply = request(s, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert status == 401 and reply["error"]["type"] == "authentication_error"
        assert request(s, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert request(s, "GET", "/health")[0] == 200  # not under /v1/
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.api, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.api, api_key="s3cret", max_retries=0)
        assert good.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_past_the_queue_limit_a_request_is_told_to_retry(folder):
    with serve(folder, "--dtype", "fp32", "--kv-memory", "16MiB", "--max-batch", "1", "--max-waiting", "2") as s:
        results = []
        body = json.dumps({"prompt": "truth", "max_tokens": 400, "temperature": 0})

        def one():
            results.append(request(s, "POST", "/v1/completions", body))

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = sorted(r[0] for r in results)
        assert 200 in statuses and 503 in statuses, statuses
        for status, headers, reply in results:
            if status == 503:
                assert headers["retry-after"] == "1" and "retry later" in reply["error"]["message"]
                assert reply["error"]["type"] == "server_overloaded"
        assert request(s, "GET", "/health")[0] == 200


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(folder):
    with serve(folder, "--dtype", "fp32", "--kv-memory", "16MiB") as s:
        client = openai.OpenAI(base_url=s.api, api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model=NAME, prompt="truth", max_tokens=200, temperature=0, stream=True)
        first = next(iter(stream))
        s.process.send_signal(signal.SIGTERM)
        rest = list(stream)  # the reply in flight runs to its end
        assert [c.choices[0].finish_reason for c in [first, *rest]][-1] in ("length", "stop")
        assert s.process.wait(30) == 0
        assert "qinfer serve: stopped" in s.log()
        with pytest.raises(OSError):
            socket.create_connection((urlparse(s.url).hostname, urlparse(s.url).port), timeout=2)


def test_sigterm_cancels_what_outlasts_the_grace_period(folder):
    with serve(folder, "--dtype", "fp32", "--kv-memory", "64MiB", "--grace", "0.5") as s:
        url = urlparse(s.url)
        body = json.dumps({"prompt": "truth", "max_tokens": CONTEXT - 64, "temperature": 0, "stream": True})
        sock = socket.create_connection((url.hostname, url.port))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        while b"data: " not in sock.recv(65536):
            pass
        start = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(30) == 0
        assert time.monotonic() - start < 15
        sock.close()


def test_a_base_model_on_all_interfaces_warns_and_refuses_chat_and_its_name_is_escaped(folder, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for f in folder.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    name = "base</script><b>"
    with serve(base, "--dtype", "fp32", "--kv-memory", "16MiB", "--host", "0.0.0.0", "--name", name) as s:
        assert "warning: listening on 0.0.0.0 without --api-key" in s.log()
        url = urlparse(s.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        conn.request("GET", "/")
        page = conn.getresponse().read().decode()
        assert "</script><b>" not in page  # no name ends the page's script
        assert json.dumps(name).replace("<", "\\u003c") in page
        status, _, reply = request(s, "POST", "/v1/chat/completions", json.dumps(CHAT | {"model": name}))
        assert status == 400 and "no chat template" in reply["error"]["message"]
        assert request(s, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}))[0] == 200


def test_a_port_in_use_is_one_error_line(folder):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "qinfer", "serve", str(folder), "--port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"Error: cannot listen on 127\.0\.0\.1:{port} \(.*\): pick another --port",
                                        lines[0]), done.stderr


def test_kv_cache_auto_takes_the_dtype_the_model_was_calibrated_for(folder, tmp_path, calib_file):
    out = tmp_path / "w4kv8"
    done = subprocess.run([sys.executable, "-m", "qinfer", "quantize", str(folder), "-o", str(out), "--method", "rtn",
                           "--group-size", "32", "--kv-cache", "int8", "--calib", str(calib_file), "--samples", "4",
                           "--seq-len", "32"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with serve(out, "--dtype", "fp32", "--kv-memory", "16MiB") as s:  # --kv-cache auto, the default
        assert "KV cache int8" in s.log()
        reply = openai.OpenAI(base_url=s.api, api_key="unused", max_retries=0).completions.create(
            model="w4kv8", prompt="truth", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1
    with serve(folder, "--dtype", "fp32", "--kv-memory", "16MiB", "--kv-cache", "auto") as s:
        assert "KV cache bf16" in s.log()  # a model without stored scales
