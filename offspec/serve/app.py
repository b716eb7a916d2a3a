"""`offspec serve`: the OpenAI HTTP API over one engine, whose requests in flight share every target pass.

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        a raw prompt
    GET  /v1/models[/{id}]      the one model served
    GET  /health                {"status": "ok"} (200) or "error" (503); details only with the key
    GET  /metrics               Prometheus' text format (metrics.py)

requests.py turns a body into the engine's request; service.py runs the engine and counts; guard.py decides who
may connect and for how long.

One thread runs Engine.run_batch over an open RequestFeed for the server's life (EngineService): a request is
tokenized and checked on the event loop, put into the feed, and a free row takes it before the next pass; each
pass's RowStep for it is handed back to the request's asyncio queue. Streamed requests send text as passes accept
tokens (server-sent events in OpenAI's chunk format, the last chunk with `usage`); the others answer once. A client
that goes away cancels its request (RequestFeed.cancel): its row is free at the next pass. At most `max_waiting`
requests wait for a row; one more is answered 429 with Retry-After. Each answer carries offspec's own figures
(`offspec`: passes, tokens per pass, seconds per token).

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a request offspec cannot run as
asked (one sentence naming the field), 401 for a wrong key, 404 for an unknown model, 408 for a body that does not
arrive, 413 for a body over the cap, 415 / 421 for what a web page could send a keyless server, 429 when the queue
is full, 503 while the server shuts down, 500 when the engine failed (and /health says so).
"""

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from offspec.engine.request import GenerationRequest
from offspec.serve.guard import MAX_BODY_BYTES, Guard
from offspec.serve.requests import ApiError, ServeConfig, model_not_found, parse_request
from offspec.serve.service import DRAINED, EngineService

BODY_TIMEOUT_S = 30.0             # a request body must arrive within this (slowloris), else 408
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
__all__ = ["ApiError", "EngineService", "ServeConfig", "make_app", "run_in_thread"]


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
    interrupted: bool = False      # ended by the server's shutdown, not by the request

    def figures(self) -> dict:
        n = len(self.tokens)
        seconds = time.perf_counter() - self.started
        return {"passes": self.passes, "tokens_per_pass": round(n / self.passes, 3) if self.passes else 0.0,
                "seconds_per_token": round(seconds / n, 4) if n else None, "seconds": round(seconds, 3),
                **({"interrupted": "the server is shutting down"} if self.interrupted else {})}

    def usage(self, prompt_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": prompt_tokens + len(self.tokens)}


def _steps(service: EngineService, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
    """Submit `request`; -> (key, queue of its RowSteps (None: the engine failed))."""
    queue: asyncio.Queue = asyncio.Queue()
    key = service.submit(request, lambda row_step: loop.call_soon_threadsafe(queue.put_nowait, row_step))
    return key, queue


def _take(answer: Answer, row_step, field: str) -> None:
    """One RowStep into the answer; ApiError if the engine refused the request (naming `field`) or failed. The
    server's shutdown (DRAINED) ends the answer with what it has (finish "length", marked interrupted)."""
    if row_step is DRAINED:
        answer.finish, answer.interrupted = "length", True
        return
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
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from offspec.engine.prompt import IncrementalText
    from offspec.serve import metrics

    app = FastAPI(title="offspec", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):       # 404, 405, ...: OpenAI's shape too
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(_, err: Exception):                  # anything else: still JSON, in OpenAI's shape
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}", kind="server_error").body(),
                            status_code=500)

    app.add_middleware(Guard, api_key=cfg.api_key, loopback=cfg.loopback, service=service, access_log=cfg.access_log)

    async def body_of(request: Request) -> dict:
        raw = bytearray()

        async def read() -> None:
            async for piece in request.stream():      # a chunked upload is counted as it arrives
                raw.extend(piece)
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s") from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:     # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
            raise ApiError(400, f"the request body is not valid JSON ({str(e)[:200]})") from None

    @app.get("/health")
    async def health(request: Request):
        """Liveness for anyone; the details only for the key's holder (or everyone on a server without one)."""
        ok = service.failure is None
        body = {"status": "ok" if ok else "error"}
        if cfg.api_key is None or request.state.key_ok:
            body.update(model=cfg.model, in_flight=service.in_flight(), waiting=service.feed.waiting(),
                        **({} if ok else {"error": service.failure}))
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(service, cfg.model), media_type="text/plain; version=0.0.4")

    model_card = {"id": cfg.model, "object": "model", "created": 0, "owned_by": "offspec"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != cfg.model:
            raise model_not_found(model)
        return model_card

    async def complete(request: Request, chat: bool):
        # Tokenizing a long prompt takes a while: off the event loop, so the other streams keep flowing.
        gen, stream = await run_in_threadpool(parse_request, await body_of(request), cfg, tokenizer, chat)
        key, queue = _steps(service, gen, asyncio.get_running_loop())
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
            finished = not answer.interrupted
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


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _stream(service, key, queue, gen, answer, text, head, chat):
    """Server-sent events: a chunk per pass that brought text, the last with finish_reason and usage, then
    [DONE] (after an error event too). A client that goes away (the generator is closed) cancels the request; a
    server that drains ends the stream at the request's next step with a proper last chunk."""
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
                yield "data: [DONE]\n\n"
                finished = True
                return
            piece = text.delta(answer.tokens, final=answer.finish is not None)
            if piece:
                yield _sse(chunk(piece, None))
        last = chunk(None, FINISH[answer.finish])
        last["usage"], last["offspec"] = answer.usage(len(gen.prompt_ids)), answer.figures()
        yield _sse(last)
        yield "data: [DONE]\n\n"
        finished = not answer.interrupted
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
