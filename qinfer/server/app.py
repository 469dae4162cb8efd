"""The OpenAI-compatible HTTP API and the web chat page, on FastAPI, in front of one engine.

Routes: ``POST /v1/chat/completions`` (messages through the model's chat template) and ``POST /v1/completions``,
each streamed (server-sent events ending in ``data: [DONE]``) or not, with ``usage``; ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus) and ``GET /`` (the chat page). Every refusal is an OpenAI-style error
body (:class:`~qinfer.server.protocol.APIError`): 400 for a bad request, 401 for a missing or wrong API key, 404 for
an unknown model or route, 503 with ``Retry-After`` when too many requests wait. A client that disconnects ends its
request, which frees its KV-cache blocks.
"""

import asyncio
import hmac
import json
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qinfer.engine.chat import encode_chat
from qinfer.engine.engine import Output
from qinfer.engine.sampling import ContextFull, SamplingParams
from qinfer.errors import QinferError
from qinfer.server.metrics import Metrics
from qinfer.server.protocol import APIError, ChatRequest, CompletionRequest, parse
from qinfer.server.runner import EngineRunner, Overloaded, Unavailable
from qinfer.sources.tokenizer import Tokenizer

MAX_BODY = 16 << 20  # bytes of a request body (a prompt of millions of tokens, far past any context)
DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming request's client is still there


@dataclass
class ServerState:
    runner: EngineRunner
    model_name: str
    created: int = 0


def create_app(runner: EngineRunner, tokenizer: Tokenizer, model_name: str, api_key: str | None = None,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The app; ``runner.run`` steps the engine beside it (on the main thread: ``qinfer.server.serve.run``). Its
    lifespan calls ``on_ready`` at startup and stops the runner at shutdown, ending every request."""
    state = ServerState(runner, model_name, int(time.time()))
    metrics = Metrics(runner)
    runner.on_output, runner.on_step = metrics.ended, metrics.stepped

    @asynccontextmanager
    async def lifespan(app):
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="qinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(APIError(400, "the request is malformed").body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: logged, never shown to the client
        traceback.print_exception(e, file=sys.stderr)
        return JSONResponse(APIError(500, "internal server error; the server's log has the details").body(),
                            status_code=500)

    if api_key is not None:
        app.add_middleware(_KeyCheck, api_key=api_key)

    @app.get("/", include_in_schema=False)
    async def page():
        html = resources.files("qinfer.server").joinpath("chat.html").read_text(encoding="utf-8")
        # the name as a JS string inside <script>: "<" escaped, so no name can end the script
        return HTMLResponse(html.replace("{{MODEL}}", json.dumps(model_name).replace("<", "\\u003c")))

    @app.get("/health")
    async def health():
        if not runner.healthy:
            return JSONResponse({"status": "unhealthy", "reason": runner.failure}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        _check_model(state, name)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatRequest, await _json(request))
        _check_model(state, body.model)
        if not tokenizer.chat_template:
            raise APIError(400, f"{model_name} has no chat template (a base model?): use /v1/completions",
                           param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            ids = encode_chat(tokenizer, messages)
        except QinferError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        return await _complete(state, request, body, ids, [], chat=True)  # an answer continues no text

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await _json(request))
        _check_model(state, body.model)
        prompt = body.prompt[0] if isinstance(body.prompt, list) and not isinstance(body.prompt[0], int) \
            else body.prompt
        if isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt)
            except QinferError as e:
                raise APIError(400, f"prompt: {e}", param="prompt") from None
        else:
            vocab = tokenizer.vocab_size
            if any(not 0 <= i < vocab for i in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        return await _complete(state, request, body, ids, ids[-1:], chat=False)

    return app


async def _json(request: Request) -> object:
    """The request's JSON body; one past ``MAX_BODY`` bytes is refused (413) before it is all read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise APIError(413, f"the request body is {int(declared)} bytes; the limit is {MAX_BODY}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise APIError(413, f"the request body is over the limit of {MAX_BODY} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)})") from None


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "qinfer",
            "max_model_len": state.runner.engine.max_tokens_held}


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist: this server runs {state.model_name!r}",
                       param="model", code="model_not_found")


def _params(state: ServerState, body, prompt_ids: list[int], chat: bool) -> SamplingParams:
    """The request's sampling settings, checked against the context and the KV cache as the engine will."""
    engine = state.runner.engine
    limit = body.limit()
    if limit is None:  # a chat without max_tokens: up to the context (or the whole cache), as OpenAI's
        limit = max(1, engine.max_tokens_held - len(prompt_ids))
    try:
        params = body.params(limit)
        engine.check(prompt_ids, params)
    except ContextFull as e:
        raise APIError(400, str(e).replace("max tokens", "max_tokens"), param="messages" if chat else "prompt",
                       code="context_length_exceeded") from None
    except QinferError as e:
        raise APIError(400, str(e).replace("--kv-memory", "the server's --kv-memory")) from None
    return params


async def _complete(state: ServerState, request: Request, body, ids: list[int], context, chat: bool):
    params = _params(state, body, ids, chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        queue = state.runner.submit(request_id, ids, params, context=context)
    except Overloaded as e:
        raise APIError(503, str(e), headers={"Retry-After": "1"}) from None
    except Unavailable as e:
        raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
    shape = _Shape(request_id, state.model_name, chat)
    if body.stream:
        return StreamingResponse(_events(state, shape, queue, body.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(state, request, shape, queue)


class _KeyCheck:
    """Refuses a ``/v1/`` request without the server's API key (``Authorization: Bearer KEY``): 401. A plain ASGI
    middleware, so streamed replies and disconnects pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:].strip() if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                what = "wrong API key" if token else "no API key: send the header 'Authorization: Bearer KEY'"
                response = JSONResponse(APIError(401, what).body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class _Shape:
    """The JSON of one request's replies: chat or text completion, whole or streamed chunks."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat, self.created = request_id, model, chat, int(time.time())

    def _envelope(self, chunk: bool, choices: list, usage: dict | None = None) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            out["usage"] = usage
        return out

    def whole(self, text: str, last: Output) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        return self._envelope(False, [choice], usage(last))

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(True, [choice])

    def usage_chunk(self, last: Output) -> dict:
        return self._envelope(True, [], usage(last))


def usage(out: Output) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _failed(error: Exception) -> APIError:
    """What a request the engine refused (400) or could not run (503) is answered with."""
    if isinstance(error, Unavailable):
        return APIError(503, str(error), headers={"Retry-After": "5"})
    return APIError(400, str(error))


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(state: ServerState, shape: _Shape, queue: asyncio.Queue, include_usage: bool) -> AsyncIterator[str]:
    """A streamed reply; if the client goes away (the generator is closed or cancelled) the request is aborted."""
    ended = False
    try:
        if shape.chat:
            yield _sse(shape.chunk(None, role=True))
        while True:
            item = await queue.get()
            if not isinstance(item, Output):  # the engine refused or failed it after the reply began
                ended = True
                yield _sse(_failed(item).body())
                break
            if item.text:
                yield _sse(shape.chunk(item.text))
            if item.finished:
                ended = True
                yield _sse(shape.chunk(None, item.finish_reason))
                if include_usage:
                    yield _sse(shape.usage_chunk(item))
                break
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            state.runner.abort(shape.id)


async def _whole(state: ServerState, request: Request, shape: _Shape, queue: asyncio.Queue) -> JSONResponse:
    """Wait for the whole reply, aborting the request if the client disconnects meanwhile."""
    texts, ended = [], False
    checked = time.monotonic()
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL)
            except asyncio.TimeoutError:
                item = None
            if time.monotonic() - checked >= DISCONNECT_POLL:  # (outputs may come faster than the poll)
                checked = time.monotonic()
                if await request.is_disconnected():
                    return JSONResponse(APIError(400, "the client disconnected").body(), status_code=400)
            if item is None:
                continue
            if not isinstance(item, Output):
                ended = True
                raise _failed(item)
            texts.append(item.text)
            if item.finished:
                ended = True
                return JSONResponse(shape.whole("".join(texts), item))
    finally:
        if not ended:
            state.runner.abort(shape.id)
