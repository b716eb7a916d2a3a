"""`offspec serve`: the OpenAI HTTP API over one engine, whose requests in flight share every target pass.

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        a raw prompt
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok"} (200), or the engine's failure (503); never asks for a key

One thread runs Engine.run_batch over an open RequestFeed for the server's life (EngineService): a request is
tokenized and checked on the event loop, put into the feed, and a free row takes it before the next pass; each
pass's RowStep for it is handed back to the request's asyncio queue. Streamed requests send text as passes accept
tokens (server-sent events in OpenAI's chunk format, the last chunk with `usage`); the others answer once. A client
that goes away cancels its request (RequestFeed.cancel): its row is free at the next pass. At most `max_waiting`
requests wait for a row; one more is answered 429 with Retry-After. Each answer carries offspec's own figures
(`offspec`: passes, tokens per pass, seconds per token).

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request offspec cannot run as
asked (one sentence naming the field), 401 for a wrong key, 413 for a body over the cap, 429 when the queue is
full, 500 when the engine failed (and /health says so).
"""

import asyncio
import hmac
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Optional

from offspec.config import SamplingConfig, TreeConfig
from offspec.engine.feed import RequestFeed
from offspec.engine.request import GenerationRequest, check_messages
from offspec.errors import InputError

MAX_BODY_BYTES = 1 << 20          # a request body larger than this is refused (413)
MAX_STOP = 4                      # stop strings a request may give, as OpenAI allows
# Fields that would change the output in a way offspec does not implement: refused, not ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "functions", "function_call",
               "best_of", "echo", "suffix", "min_p", "repetition_penalty")
PENALTIES = ("presence_penalty", "frequency_penalty")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class ApiError(Exception):
    """An OpenAI-style error answer: status, one-sentence message, type, the offending field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServeConfig:
    """What the server was started with."""
    model: str                    # the name /v1/models lists and requests must use
    tree: TreeConfig              # every request's tree (the command's --tree options)
    sampling: SamplingConfig      # defaults a request's own temperature / top_p / seed replace
    max_tokens: int               # the most new tokens a request may ask for, and the default
    max_waiting: int              # requests that may wait for a row; one more gets 429
    context: int                  # tokens a request may reach (the engine's): a longer prompt is refused, and
                                  # generation ends there (finish_reason "length")
    api_key: Optional[str] = None


# ---------------------------------------------------------------- requests in

def _number(body: dict, name: str, low: float, high: float, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}, not {value!r}", name)
    return value


def _max_tokens(body: dict, cfg: ServeConfig) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return cfg.max_tokens
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"{name} must be a positive integer, not {value!r}", name)
    if value > cfg.max_tokens:
        raise ApiError(400, f"{name} is {value}; this server allows at most {cfg.max_tokens}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return tuple(stop)


def _check_supported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"n must be 1: offspec returns one choice a request (asked for {body.get('n')!r})", "n")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported by offspec", name)
    for name in PENALTIES:
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported by offspec (it would change the model's distribution)",
                           name)
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than text is not supported by offspec", "response_format")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")


def _messages(body: dict) -> list[dict]:
    """OpenAI messages -> [{role, content}] with text content (a list of text parts is joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, "message content parts must be text ({type: text, text}); offspec reads text",
                               "messages")
            content = "".join(p["text"] for p in content)
        out.append({"role": m.get("role") if isinstance(m, dict) else None, "content": content})
    try:
        check_messages(out)
    except InputError as e:
        raise ApiError(400, str(e), "messages") from None
    return out


def parse_request(body: dict, cfg: ServeConfig, tokenizer, chat: bool) -> tuple[GenerationRequest, bool]:
    """An OpenAI request body -> (the engine's request, stream?), or ApiError naming the field. (stream_options is
    checked and otherwise not needed: the last chunk always carries usage.)"""
    from offspec.engine.prompt import encode_prompt

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model != cfg.model:
        raise ApiError(400, f"model {model!r} is not served here; this server serves {cfg.model!r}", "model",
                       code="model_not_found")
    _check_supported(body)
    if chat:
        prompt = _messages(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", "prompt")
    sampling = SamplingConfig(temperature=_number(body, "temperature", 0, 2, cfg.sampling.temperature),
                              top_p=_number(body, "top_p", 0, 1, cfg.sampling.top_p), top_k=cfg.sampling.top_k,
                              seed=cfg.sampling.seed)
    if sampling.top_p <= 0:
        raise ApiError(400, "top_p must be above 0", "top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"seed must be an integer, not {seed!r}", "seed")
    # No seed: a fresh one, as OpenAI draws (the same sampled request twice gives two answers).
    sampling = replace(sampling, seed=secrets.randbits(63) if seed is None else seed % 2**63)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    field = "messages" if chat else "prompt"
    max_tokens, stop = _max_tokens(body, cfg), _stop(body)
    try:
        ids = encode_prompt(tokenizer, prompt, raw=not chat)
    except Exception as e:       # InputError, or the chat template's own refusal (roles must alternate, ...)
        raise ApiError(400, f"{field} cannot be encoded: {(str(e).splitlines() or [type(e).__name__])[0]}",
                       field) from None
    if len(ids) + 1 >= cfg.context:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; this server's context holds {cfg.context} (prompt and "
                       f"new tokens together)", field, code="context_length_exceeded")
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=min(max_tokens, cfg.context - len(ids) - 1),
                                stop_strings=stop, tree=cfg.tree, sampling=sampling)
    return request, stream


# ---------------------------------------------------------------- the engine's thread

class EngineService:
    """Engine.run_batch over an open RequestFeed on its own thread; each request's RowSteps go to its callback
    (called on the engine's thread). A request the engine refuses gets its error; if the engine fails, every
    request in flight gets the failure and `failure` says it."""

    def __init__(self, engine, concurrency: int, max_waiting: int):
        self.engine, self.rows, self.max_waiting = engine, concurrency, max_waiting
        self.feed = RequestFeed()
        self.failure: Optional[str] = None
        self.passes = 0.0              # target passes run: each RowStep counts 1 / the rows that shared its pass
        self._callbacks: dict[int, object] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._thread = threading.Thread(target=self._run, args=(concurrency,), name="offspec-engine", daemon=True)
        self._thread.start()

    def _run(self, concurrency: Optional[int]) -> None:
        try:
            for row_step in self.engine.run_batch(self.feed, concurrency=concurrency):
                if row_step.step is not None:
                    self.passes += 1 / row_step.step.rows_in_pass
                with self._lock:
                    callback = self._callbacks.get(row_step.request)
                if callback is not None:
                    callback(row_step)
        except BaseException as err:       # the engine is gone: tell every request in flight, and /health
            with self._lock:
                self.failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                callbacks = list(self._callbacks.values())
            for callback in callbacks:
                callback(None)

    def submit(self, request: GenerationRequest, callback) -> int:
        """Queue `request`; -> its key. ApiError 429 when every row is taken and max_waiting requests already wait
        for one."""
        with self._lock:
            if self.failure is not None:
                raise ApiError(500, f"the engine failed: {self.failure}", kind="server_error")
            if len(self._callbacks) >= self.rows + self.max_waiting:
                raise ApiError(429, f"all {self.rows} rows are taken and {self.max_waiting} requests wait for one; "
                               f"retry shortly", kind="rate_limit_error", headers={"Retry-After": "1"})
            key, self._next = self._next, self._next + 1
            self._callbacks[key] = callback
        self.feed.put([(key, request)])
        return key

    def in_flight(self) -> int:
        """Requests submitted and not answered yet."""
        with self._lock:
            return len(self._callbacks)

    def done(self, key: int, cancel: bool) -> None:
        """The request under `key` is answered (or its client left: cancel frees its row at the next pass)."""
        with self._lock:
            self._callbacks.pop(key, None)
        if cancel:
            self.feed.cancel(key)
        self.feed.forget(key)

    def close(self) -> None:
        self.feed.close()
        self._thread.join(timeout=30)


# ---------------------------------------------------------------- answers

@dataclass
class Answer:
    """What one request produced so far."""
    tokens: list
    passes: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    finish: Optional[str] = None
    started: float = 0.0

    def figures(self) -> dict:
        n = len(self.tokens)
        seconds = time.perf_counter() - self.started
        return {"passes": self.passes, "tokens_per_pass": round(n / self.passes, 3) if self.passes else 0.0,
                "seconds_per_token": round(seconds / n, 4) if n else None, "seconds": round(seconds, 3)}

    def usage(self, prompt_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": prompt_tokens + len(self.tokens)}


def _steps(service: EngineService, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
    """Submit `request`; -> (key, queue of its RowSteps (None: the engine failed))."""
    queue: asyncio.Queue = asyncio.Queue()
    key = service.submit(request, lambda row_step: loop.call_soon_threadsafe(queue.put_nowait, row_step))
    return key, queue


def _take(answer: Answer, row_step, field: str) -> None:
    """One RowStep into the answer; ApiError if the engine refused the request (naming `field`) or failed."""
    if row_step is None:
        raise ApiError(500, "the engine failed while running this request", kind="server_error")
    if row_step.error is not None:
        raise ApiError(400, str(row_step.error), field)
    step = row_step.step
    if step.tokens or step.finish_reason:
        answer.passes += 1
    answer.tokens += step.tokens
    answer.target_seconds += step.target_seconds
    answer.draft_seconds += step.draft_seconds
    answer.finish = step.finish_reason


def make_app(service: EngineService, cfg: ServeConfig, tokenizer):
    """The FastAPI application."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from offspec.engine.prompt import IncrementalText

    app = FastAPI(title="offspec", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    app.add_middleware(_Guard, api_key=cfg.api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):       # 404, 405, ...: OpenAI's shape too
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    async def body_of(request: Request) -> dict:
        raw = bytearray()
        async for piece in request.stream():          # a chunked upload is counted as it arrives
            raw += piece
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:     # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
            raise ApiError(400, f"the request body is not valid JSON ({str(e)[:200]})") from None

    @app.get("/health")
    async def health():
        if service.failure is not None:
            return JSONResponse({"status": "error", "error": service.failure}, status_code=503)
        return {"status": "ok", "model": cfg.model, "waiting": service.feed.waiting()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model, "object": "model", "created": 0, "owned_by": "offspec"}]}

    async def complete(request: Request, chat: bool):
        # Tokenizing a long prompt takes a while: off the event loop, so the other streams keep flowing.
        gen, stream = await run_in_threadpool(parse_request, await body_of(request), cfg, tokenizer, chat)
        loop = asyncio.get_running_loop()
        key, queue = _steps(service, gen, loop)
        answer = Answer(tokens=[], started=time.perf_counter())
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": cfg.model}
        text = IncrementalText(tokenizer, gen.stop_strings)
        if stream:
            return StreamingResponse(_stream(service, key, queue, gen, answer, text, head, chat),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finished = False
        try:
            while answer.finish is None:
                try:
                    _take(answer, await asyncio.wait_for(queue.get(), timeout=1.0), "messages" if chat else "prompt")
                except asyncio.TimeoutError:
                    pass
                if answer.finish is None and await request.is_disconnected():    # (checked every pass, or second)
                    return JSONResponse({}, status_code=499)
            finished = True
        finally:
            service.done(key, cancel=not finished)
        content = text.text(answer.tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content},
                   "finish_reason": FINISH[answer.finish]} if chat else
                  {"index": 0, "text": content, "logprobs": None, "finish_reason": FINISH[answer.finish]})
        return {**head, "choices": [choice], "usage": answer.usage(len(gen.prompt_ids)), "offspec": answer.figures()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


class _Guard:
    """Pure ASGI middleware (it leaves `receive` alone, so a handler still sees its client disconnect): the API key
    on every route but /health (401), and a declared body over the cap (413)."""

    def __init__(self, app, api_key: Optional[str]):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from fastapi.responses import JSONResponse
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            err = None
            if self.api_key is not None and scope.get("path") != "/health" and not hmac.compare_digest(
                    headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()):
                err = ApiError(401, "incorrect or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
            length = headers.get("content-length")
            if err is None and length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
                err = ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
            if err is not None:
                await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _stream(service, key, queue, gen, answer, text, head, chat):
    """Server-sent events: a chunk per pass that brought text, the last with finish_reason and usage, then
    [DONE]. A client that goes away (the generator is closed) cancels the request."""
    chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(piece: Optional[str], finish: Optional[str], first: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else {} if piece is None else {"content": piece})
            return {**chunk_head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return {**chunk_head, "choices": [{"index": 0, "text": piece or "", "logprobs": None,
                                           "finish_reason": finish}]}

    finished = False
    try:
        if chat:
            yield _sse(chunk(None, None, first=True))
        while answer.finish is None:
            try:
                _take(answer, await queue.get(), "messages" if chat else "prompt")
            except ApiError as err:
                yield _sse(err.body())
                finished = True
                return
            piece = text.delta(answer.tokens, final=answer.finish is not None)
            if piece:
                yield _sse(chunk(piece, None))
        last = chunk(None, FINISH[answer.finish])
        last["usage"], last["offspec"] = answer.usage(len(gen.prompt_ids)), answer.figures()
        yield _sse(last)
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        service.done(key, cancel=not finished)


def run_in_thread(app, host: str = "127.0.0.1", port: int = 0):
    """`app` served on a thread of this process (tests, benchmarks) -> (the uvicorn server, its thread, its base
    URL). port 0: a free one. Stop it with server.should_exit = True, then join the thread."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="offspec-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://{host}:{port}"
