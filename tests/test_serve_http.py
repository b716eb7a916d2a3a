"""`offspec serve` against what clients send and what a web page or a stalled reader could do: the requests of
Continue, Open WebUI, LangChain and the openai client as they send them by default, the raw server-sent events,
clamped max_tokens and long stop lists, fields honoured or refused (never ignored), the keyless loopback server's
Host and Content-Type checks, the key matched on bytes, /health, /metrics, /v1/models/{id}, JSON 500s, the 429 gate
counting engine rows, slow bodies, stalled readers, and SIGTERM ending every stream with a last chunk."""
import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import KEY, Server, pair, server, solo  # noqa: E402,F401  (fixtures)

from offspec.config import SamplingConfig  # noqa: E402
from offspec.serve import guard  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "hello"}]
CONTINUE_STOPS = ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>", "<end_of_turn>", "[/INST]", "\n\nUser:",
                  "\n\nHuman:", "<|end|>", "<|user|>", "<|assistant|>", "```\n\n", "\n\n\n", "<fim_prefix>",
                  "<fim_suffix>", "<fim_middle>", "<|file_separator|>", "USER:"]


def events(url: str, body: dict, headers=AUTH) -> list[str]:
    """The raw server-sent events of a streamed answer, as sent: every `data: ...` payload in order."""
    with httpx.stream("POST", url, headers=headers, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    payloads = [e for e in raw.split("\n\n") if e]
    assert all(p.startswith("data: ") for p in payloads), raw
    return [p.removeprefix("data: ") for p in payloads]


def test_the_raw_stream_is_role_content_last_chunk_usage_done(server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 24, "stream": True,
            "stream_options": {"include_usage": True}}
    payloads = events(f"{server.url}/v1/chat/completions", body)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    middle = chunks[1:-1]
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None
                          for c in middle)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last["usage"]["completion_tokens"] > 0
    text, tokens = solo(server, HELLO)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == text
    assert last["usage"]["completion_tokens"] == len(tokens)


@pytest.mark.parametrize("client,body", [
    ("continue", {"messages": HELLO, "max_tokens": 4096, "temperature": 0.01, "stream": True, "stop": CONTINUE_STOPS}),
    ("open-webui", {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}),
    ("langchain", {"messages": HELLO, "stream": False, "n": 1, "temperature": 0.7, "top_p": 1, "stop": None,
                   "presence_penalty": 0, "frequency_penalty": 0, "max_completion_tokens": 5000}),
    ("openai", {"messages": HELLO, "max_completion_tokens": 12, "user": "u1", "metadata": {"a": "b"},
                "store": False, "parallel_tool_calls": None}),
])
def test_the_usual_clients_requests_are_answered(server, client, body):
    """As each client sends them by default: a max_tokens past the server's 64 is clamped (the answer ends with
    `length` at 64 tokens), a long stop list is taken."""
    body = {"model": "tiny", **body}
    if body.get("stream"):
        chunks = [json.loads(p) for p in events(f"{server.url}/v1/chat/completions", body)[:-1]]
        finish, used = chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["usage"]["completion_tokens"]
    else:
        r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=body, timeout=60)
        assert r.status_code == 200, r.text
        finish, used = r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or 64
    assert used <= min(asked, 64) and (finish == "stop" or used == min(asked, 64))


def test_a_clamped_request_equals_the_request_at_the_cap(server):
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny", "prompt": "abc", "max_tokens": 100_000, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo(server, "abc", chat=False, max_tokens=64)[0]


def test_fields_are_honoured_or_refused(server):
    """top_k and ignore_eos change the answer as they say (the same as the request run alone with them); the
    fields offspec does not implement are taken with the values that change nothing (the defaults many clients
    send) and refused naming the field otherwise, as are min_tokens and stop lists too long or with a string too
    long."""
    ask = {"model": "tiny", "prompt": "abc", "max_tokens": 16, "temperature": 1.0, "seed": 3}
    got = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={**ask, "top_k": 2}, timeout=60).json()
    want, _ = solo(server, "abc", chat=False, max_tokens=16, sampling=SamplingConfig(temperature=1.0, top_k=2, seed=3))
    assert got["choices"][0]["text"] == want
    eos = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                     json={"model": "tiny", "prompt": "abc", "max_tokens": 40, "ignore_eos": True}).json()
    assert eos["usage"]["completion_tokens"] == 40 and eos["choices"][0]["finish_reason"] == "length"
    neutral = {"repetition_penalty": 1.0, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
               "logprobs": False, "tools": [], "logit_bias": {}, "best_of": 1, "echo": False, "typical_p": 1}
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={**ask, **neutral})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == httpx.post(
        f"{server.url}/v1/completions", headers=AUTH, json=ask).json()["choices"][0]["text"]
    for field, value in (("repetition_penalty", 1.1), ("logprobs", 0), ("tools", [{"type": "function"}]),
                         ("min_tokens", 5), ("stop", ["x"] * 65), ("stop", ["x" * 257]), ("top_k", -2),
                         ("guided_json", {"type": "object"}), ("stop_token_ids", [3]), ("ignore_eos", "yes")):
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={**ask, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_models_health_metrics_and_errors(server):
    """GET /v1/models/{id} (404 for another model, as a request naming it is); /health shows liveness alone
    without the key; /metrics counts; an exception outside the API's own is a JSON 500."""
    assert httpx.get(f"{server.url}/v1/models/tiny", headers=AUTH).json()["id"] == "tiny"
    r = httpx.get(f"{server.url}/v1/models/other", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json={"model": "other", "messages": HELLO})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    detailed = httpx.get(f"{server.url}/health", headers=AUTH).json()
    assert detailed["model"] == "tiny" and "in_flight" in detailed
    httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "a", "max_tokens": 4})
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert samples['offspec_requests_total{model="tiny",status="200"}'] >= 1
    assert samples['offspec_generated_tokens_total{model="tiny"}'] >= 4
    assert samples['offspec_target_passes_total{model="tiny"}'] > 0 and samples['offspec_engine_up{model="tiny"}'] == 1
    assert "# TYPE offspec_rows_in_flight gauge" in text and 'offspec_queue_depth{model="tiny"} 0' in text

    def broken(*args, **kwargs):
        raise KeyError("not an API error")
    original, server.service.submit = server.service.submit, broken
    try:
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "a"})
    finally:
        server.service.submit = original
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "server_error"


def test_the_key_is_matched_as_bytes_with_the_scheme_in_any_case(pair):
    s = Server(*pair, api_key="clé-secrète")
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        for header, status in ((b"Bearer cl\xc3\xa9-secr\xc3\xa8te", 200), (b"bearer cl\xc3\xa9-secr\xc3\xa8te", 200),
                               (b"BEARER  cl\xc3\xa9-secr\xc3\xa8te", 200), (b"Bearer cle-secrete", 401),
                               (b"Basic cl\xc3\xa9-secr\xc3\xa8te", 401), (b"", 401)):
            r = httpx.post(f"{s.url}/v1/completions", headers=[(b"authorization", header)], json=body)
            assert r.status_code == status, header
            assert "secr" not in r.text
    finally:
        s.close()


def test_a_keyless_loopback_server_refuses_what_a_web_page_could_send(pair):
    """No key on loopback: a Host that is not loopback (DNS rebinding) is 421 and a body that is not JSON (a page's
    text/plain POST needs no preflight) 415; the ordinary client is served."""
    s = Server(*pair, api_key=None)
    try:
        body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2})
        ok = httpx.post(f"{s.url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert ok.status_code == 200
        charset = httpx.post(f"{s.url}/v1/completions", content=body,
                             headers={"Content-Type": "application/json; charset=utf-8"})
        assert charset.status_code == 200
        r = httpx.post(f"{s.url}/v1/completions", content=body, headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = httpx.post(f"{s.url}/v1/completions", content=body,
                       headers={"Content-Type": "application/json", "Host": "evil.example:8000"})
        assert r.status_code == 421
        assert httpx.get(f"{s.url}/health", headers={"Host": "localhost:1"}).json()["status"] == "ok"
        assert httpx.get(f"{s.url}/v1/models", headers={"Host": "attacker.test"}).status_code == 421
    finally:
        s.close()


def test_the_gate_counts_engine_rows_not_slow_readers(pair):
    """One row, no room to wait: a client that streams a request and then stops reading holds no row once its
    request is generated, so the next request is served, not 429."""
    s = Server(*pair, max_waiting=0, concurrency=1)
    try:
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", headers=AUTH,
                          json={"model": "tiny", "messages": HELLO, "max_tokens": 8, "stream": True}) as stalled:
            assert stalled.status_code == 200                   # headers read, the body left unread
            deadline = time.time() + 30
            while s.service.in_flight() and time.time() < deadline:
                time.sleep(0.05)
            assert s.service.in_flight() == 0 and s.service.answering() <= 1
            r = httpx.post(f"{s.url}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "a",
                                                                          "max_tokens": 2}, timeout=30)
            assert r.status_code == 200
    finally:
        s.close()


def test_a_slow_body_is_408(server, monkeypatch):
    from offspec.serve import app
    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.5)

    def slowly():
        yield b'{"model": "tiny", '
        time.sleep(2)
        yield b'"prompt": "a"}'
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, content=slowly(), timeout=10)
    assert r.status_code == 408 and r.json()["error"]["message"]


def test_a_stalled_reader_is_dropped_after_the_write_timeout(monkeypatch):
    """A send the client does not take within WRITE_TIMEOUT_S ends the connection (the guard returns, the server
    closes the unfinished answer): the app is not kept waiting on the reader."""
    monkeypatch.setattr(guard, "WRITE_TIMEOUT_S", 0.2)
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})

    async def stalled_send(message):
        sent.append(message["type"])
        if message["type"] == "http.response.body":
            await asyncio.sleep(60)                            # the client's buffer is full: it never drains

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [(b"host", b"127.0.0.1")]}
    started = time.perf_counter()
    asyncio.run(guard.Guard(app, api_key=None, loopback=True)(scope, None, stalled_send))
    assert time.perf_counter() - started < 5 and sent == ["http.response.start", "http.response.body"]


def start_serve(pair, tmp_path, *options) -> tuple[subprocess.Popen, str]:
    """`offspec serve` in its own process on a free port, its engine slowed to a round per 0.3 s (so that answers
    are mid-stream when the test acts), once /health answers -> (process, base URL)."""
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import sys, time; from offspec.engine.generate import Engine; r = Engine._round\n"
            "def slow(self, *a, **k):\n    time.sleep(0.3)\n    return r(self, *a, **k)\n"
            "Engine._round = slow; from offspec.cli.main import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--target", str(pair[0]), "--draft", str(pair[1]),
                             "--device", "cpu", "--dtype", "float32", "--port", str(port), "--model-name", "tiny",
                             "--tree-budget", "8", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "OFFSPEC_HOME": str(tmp_path / "home")})
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health").json()["status"] == "ok":
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("offspec serve did not start")


def test_a_load_of_mixed_clients_then_sigterm(server, pair, tmp_path):
    """The bounded load test: 24 streaming clients (12 short answers that finish, 12 long ones still running),
    clients that leave after their first chunk, readers that stall, malformed bodies and wrong keys, then SIGTERM.
    Every stream ends with [DONE]; each finished answer is its request's alone (the in-process server's engine on
    the same pair), each interrupted one a prefix of it ending with a last chunk (finish_reason "length",
    offspec.interrupted); the process ends, as the signal asks, well within --shutdown-timeout."""
    proc, url = start_serve(pair, tmp_path, "--api-key", KEY, "--shutdown-timeout", "10", "--max-tokens", "200",
                            "--concurrency", "32")
    streams, noise, release = [], [], threading.Event()
    prompts = [f"story {i}" for i in range(24)]

    def stream(i):
        short = i % 2 == 0
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompts[i]}], "stream": True,
                **({"max_tokens": 8} if short else {"max_tokens": 200, "stop": ["NEVER"], "ignore_eos": True})}
        streams.append((i, events(f"{url}/v1/chat/completions", body)))

    def leave():
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json={
                "model": "tiny", "messages": HELLO, "max_tokens": 100, "stream": True}) as r:
            next(r.iter_lines())
            noise.append(r.status_code)

    def stall():
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json={
                    "model": "tiny", "messages": HELLO, "max_tokens": 100, "stream": True}) as r:
                noise.append(r.status_code)
                release.wait(timeout=60)
        except httpx.TransportError:
            pass

    def malformed():
        noise.append(httpx.post(f"{url}/v1/chat/completions", headers=AUTH, content=b"{nope").status_code)

    def wrong_key():
        noise.append(httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer no"},
                                json={"model": "tiny", "messages": HELLO}).status_code)

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(24)]
        threads += [threading.Thread(target=f) for f in [leave] * 3 + [stall] * 3 + [malformed] * 3 + [wrong_key] * 3]
        for t in threads:
            t.start()
        for t in threads[:24:2]:                 # the short answers finish (the long ones run on meanwhile)
            t.join(timeout=60)
        time.sleep(1)
        stopped = time.time()
        proc.send_signal(signal.SIGTERM)
        for t in threads[:24]:
            t.join(timeout=30)
        output = proc.communicate(timeout=30)[0]
        release.set()
        # uvicorn re-raises the signal once drained, so the process ends as SIGTERM asked (status 143 in a shell)
        assert proc.returncode == -signal.SIGTERM and time.time() - stopped < 15, output
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
    assert sorted(noise) == [200] * 6 + [400] * 3 + [401] * 3
    assert len(streams) == 24
    for i, payloads in streams:
        assert payloads[-1] == "[DONE]", payloads
        chunks = [json.loads(p) for p in payloads[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        last = chunks[-1]
        if i % 2 == 0:
            assert "interrupted" not in last["offspec"] and last["choices"][0]["finish_reason"] in ("stop", "length")
            assert text == solo(server, [{"role": "user", "content": prompts[i]}], max_tokens=8)[0]
        else:
            assert last["choices"][0]["finish_reason"] == "length" and last["offspec"]["interrupted"]
            alone = solo(server, [{"role": "user", "content": prompts[i]}],
                         max_tokens=last["usage"]["completion_tokens"])[0]        # (it may stop at its EOS)
            assert text.startswith(alone)
    assert "Traceback" not in output and "GET /health 200" in output and KEY not in output, output


def test_the_server_is_configured_to_drain_and_to_bound_connections():
    """`offspec serve`'s uvicorn server: SIGTERM drains the service before uvicorn's own shutdown, which waits at
    most --shutdown-timeout; connections are capped and idle keep-alives closed."""
    from offspec.cli.serve import draining_server

    class Service:
        drained = False

        def drain(self):
            self.drained = True
    service = Service()
    server = draining_server(object(), service, "127.0.0.1", 0, shutdown_timeout=7.5, connections=90)
    assert server.config.timeout_graceful_shutdown == 7.5 and server.config.limit_concurrency == 90
    assert server.config.timeout_keep_alive == 5
    server.handle_exit(signal.SIGTERM, None)
    assert service.drained and server.should_exit
