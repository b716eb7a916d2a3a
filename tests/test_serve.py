"""`offspec serve`: the OpenAI API over one engine, on loopback, with the official `openai` client and raw HTTP.
Each answer equals the same request run alone; concurrent streams share passes; clients that leave free their
rows; bad requests and wrong keys are OpenAI-style errors while the others carry on."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tiny import save_agreeing_pair  # noqa: E402

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, SamplingConfig, TreeConfig  # noqa: E402
from offspec.engine.generate import GenerationRequest, run  # noqa: E402
from offspec.engine.load import load_engine  # noqa: E402
from offspec.engine.prompt import encode_prompt  # noqa: E402
from offspec.errors import InputError
from offspec.serve.app import EngineService, ServeConfig, make_app, run_in_thread  # noqa: E402

KEY = "sk-test"
TREE = TreeConfig(policy="dyspec", budget=8)
CONCURRENCY = 8


class Server:
    """The app on a free loopback port, in a thread; .url, .service, .engine."""

    def __init__(self, target, draft, max_waiting=64, api_key=KEY, concurrency=CONCURRENCY):
        self.loaded = load_engine(target, draft, OffloadConfig(), RuntimeConfig(torch.device("cpu"), torch.float32),
                                  limits=RunLimits(context=160, tree_budget=8, concurrency=concurrency, sampling=True),
                                  progress=False)
        self.engine = self.loaded.engine
        self.service = EngineService(self.engine, concurrency, max_waiting)
        self.cfg = ServeConfig(model="tiny", tree=TREE, sampling=SamplingConfig(), max_tokens=64,
                               max_waiting=max_waiting, context=160, api_key=api_key)
        self.server, self.thread, self.url = run_in_thread(make_app(self.service, self.cfg, self.engine.tokenizer))

    def client(self, key=KEY):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.close()
        self.engine.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft, _ = save_agreeing_pair(tmp_path_factory.mktemp("serve"), n_layers=2)
    return target, draft


@pytest.fixture(scope="module")
def server(pair):
    s = Server(*pair)
    yield s
    s.close()


def solo(server, prompt, chat=True, max_tokens=24, sampling=SamplingConfig(), stop=()):
    """The request run alone on the same engine (as `offspec generate` runs it): (text, tokens)."""
    ids = encode_prompt(server.engine.tokenizer, prompt, raw=not chat)
    report, _ = run(server.engine, GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=max_tokens, tree=TREE,
                                                     sampling=sampling, stop_strings=stop))
    return report.text, report.tokens


PROMPTS = ["abc", "hello there", "the quick brown fox", "0123", "zzz", "What is 2+2?", "x", "Tell me a story"]


def test_chat_and_completions_with_the_openai_client(server):
    """Non-streaming and streaming, chat and completions: each text is the request run alone; usage and offspec's
    own figures come with it."""
    client = server.client()
    messages = [{"role": "user", "content": "hello"}]
    want, tokens = solo(server, messages)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == len(tokens) and got.usage.prompt_tokens > 0
    assert got.model_extra["offspec"]["passes"] >= 1 and got.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == len(tokens) and chunks[-1].choices[0].finish_reason is not None
    want, _ = solo(server, "abc", chat=False)
    assert client.completions.create(model="tiny", prompt="abc", max_tokens=24).choices[0].text == want
    streamed = client.completions.create(model="tiny", prompt="abc", max_tokens=24, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_seeded_sampled_request_is_reproducible(server):
    client = server.client()
    ask = dict(model="tiny", messages=[{"role": "user", "content": "abc"}], max_tokens=20, temperature=1.0, seed=7)
    first, second = (client.chat.completions.create(**ask).choices[0].message.content for _ in range(2))
    assert first == second
    want, _ = solo(server, ask["messages"], max_tokens=20, sampling=SamplingConfig(temperature=1.0, seed=7))
    assert first == want


def test_32_concurrent_streams_share_passes_and_answer_as_alone(server):
    """32 streaming clients at once (8 rows in flight, the rest waiting for a row), with clients that leave after
    their first chunk, readers that stall, malformed requests and wrong keys mixed in (the SIGTERM of such a server:
    test_serve_http.py): every stream completes with the text of its
    request run alone, in the passes it took alone; the engine ran far fewer passes than the solo runs' sum; the
    rows of the clients that left are free afterwards."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    want = [solo(server, [{"role": "user", "content": p}]) for p in prompts]
    passes_before = server.service.passes
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 64, "stream": True}

    def ask(prompt):
        stream = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                          max_tokens=24, stream=True)
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].model_extra

    def leave():
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=headers, json=body) as r:
            next(r.iter_lines())
            return r.status_code

    release = __import__("threading").Event()

    def stall():        # a reader that takes its headers, then reads nothing until the end of the test
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=headers, json=body) as r:
            release.wait(timeout=120)
            return r.status_code

    def malformed():
        return httpx.post(f"{server.url}/v1/chat/completions", headers=headers, content=b"{nope").status_code

    def wrong_key():
        return httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer no"},
                          json=body).status_code

    with ThreadPoolExecutor(52) as pool:
        stalled = [pool.submit(stall) for _ in range(4)]
        streams = [pool.submit(ask, p) for p in prompts]
        noise = [pool.submit(f) for f in [leave] * 6 + [malformed] * 5 + [wrong_key] * 5]
        answers = [f.result() for f in streams]
        assert [f.result() for f in noise] == [200] * 6 + [400] * 5 + [401] * 5
        deadline = time.time() + 20
        while server.service.in_flight() and time.time() < deadline:      # the stalled readers hold no row
            time.sleep(0.05)
        assert server.service.in_flight() == 0
        release.set()
        assert [f.result() for f in stalled] == [200] * 4
    shared = server.service.passes - passes_before
    assert [text for text, _ in answers] == [text for text, _ in want]
    solo_passes = sum(extra["offspec"]["passes"] for _, extra in answers)
    assert shared < solo_passes / 3, (shared, solo_passes)
    alone = [server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                     max_tokens=24).model_extra["offspec"]["passes"] for p in prompts]
    assert alone == [extra["offspec"]["passes"] for _, extra in answers]     # each row's own passes, as alone
    deadline = time.time() + 20
    while server.service.in_flight() and time.time() < deadline:
        time.sleep(0.05)
    assert server.service.in_flight() == 0


def test_bad_requests_are_openai_errors_and_the_others_carry_on(server):
    """Malformed JSON, a wrong model (404, as OpenAI and vLLM answer), empty messages, max_tokens <= 0, a negative temperature, n > 1, an unsupported
    field, a prompt longer than the context, a wrong key: each one status and {"error": {...}} naming the field,
    mixed into streaming load that completes."""
    cases = [
        (b"{not json", 400, None), ({"model": "other", "messages": [{"role": "user", "content": "a"}]}, 404, "model"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "a"}], "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "a"}], "n": 2}, 400, "n"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "a"}], "logprobs": True}, 400, "logprobs"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "a" * 400}]}, 400, "messages"),
    ]
    with ThreadPoolExecutor(8) as pool:
        load = [pool.submit(lambda p=p: "".join(c.choices[0].delta.content or "" for c in server.client()
                                                 .chat.completions.create(model="tiny", stream=True, max_tokens=16,
                                                                          messages=[{"role": "user", "content": p}])
                                                 if c.choices)) for p in PROMPTS]
        for body, status, param in cases:
            r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                           content=body if isinstance(body, bytes) else json.dumps(body))
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
        r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer wrong"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"       # no key needed
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        texts = [f.result() for f in load]
    assert texts == [solo(server, [{"role": "user", "content": p}], max_tokens=16)[0] for p in PROMPTS]


def test_clients_that_leave_free_their_rows(server):
    """Streams closed after their first chunk: their requests are cancelled (rows freed within a few passes, not
    run to max_tokens: the same request alone takes `alone` passes), and the requests after them complete."""
    alone = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "abc"}], max_tokens=64, stop=["NEVER"],
        extra_body={"ignore_eos": True}).model_extra["offspec"]["passes"]
    assert alone >= 8
    before = server.service.passes
    for _ in range(6):
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 64,
                                "stream": True, "stop": ["NEVER"], "ignore_eos": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    deadline = time.time() + 20
    while server.service.in_flight() and time.time() < deadline:
        time.sleep(0.05)
    assert server.service.in_flight() == 0
    assert server.service.passes - before <= 6 * 3 < 6 * alone       # each cancelled within three passes
    text = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}],
                                                   max_tokens=8).choices[0].message.content
    assert text == solo(server, [{"role": "user", "content": "abc"}], max_tokens=8)[0]


def test_a_full_queue_is_429_with_retry_after(pair):
    """One row, no room to wait: while a request holds the row (the engine still generating it), another is 429
    with Retry-After; once it is cancelled, the next one runs."""
    s = Server(*pair, max_waiting=0, concurrency=1)
    try:
        holder = s.service.submit(GenerationRequest(prompt_ids=(5, 6, 7), max_new_tokens=120, ignore_eos=True),
                                  lambda row_step: time.sleep(0.05))        # (on the engine's thread: slows it)
        r = httpx.post(f"{s.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "prompt": "abc", "max_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        s.service.done(holder, cancel=True)
        r = httpx.post(f"{s.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "prompt": "abc", "max_tokens": 4})
        assert r.status_code == 200            # the row is free again
    finally:
        s.close()


def test_an_engine_failure_is_500_and_health_says_so(pair):
    """The engine's thread fails mid-run: the request in flight ends with 500 and a message, /health answers 503
    (the failure itself to the key's holder), later requests are 500 at once (not queued forever), and the service
    tells its owner (`offspec serve` then stops and exits non-zero, for a supervisor to restart it)."""
    s = Server(*pair)
    failures = []
    s.service.on_failure = failures.append
    try:
        def fail(*args, **kwargs):
            raise RuntimeError("simulated device failure")
        s.engine._round = fail
        body = {"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 8}
        headers = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(f"{s.url}/v1/chat/completions", headers=headers, json=body, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        health = httpx.get(f"{s.url}/health")
        assert health.status_code == 503 and health.json() == {"status": "error"}
        health = httpx.get(f"{s.url}/health", headers=headers)
        assert health.status_code == 503 and "simulated device failure" in health.json()["error"]
        assert len(failures) == 1 and "simulated device failure" in failures[0]
        r = httpx.post(f"{s.url}/v1/chat/completions", headers=headers, json=body, timeout=30)
        assert r.status_code == 500 and "simulated device failure" in r.json()["error"]["message"]
    finally:
        s.close()


def test_a_body_over_the_cap_is_413(server):
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=b'{"model": "tiny", "prompt": "' + b"a" * (1 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_a_non_streaming_client_that_leaves_is_cancelled(pair):
    """A client that gives up on a non-streaming answer (its timeout) frees its row: the server notices the
    disconnect while the engine runs (slowed here to a round per 0.5 s, so its 64 tokens would take 5 s or more)
    and cancels the request within a few rounds (alone, the request takes at least 8)."""
    s = Server(*pair)
    try:
        rounds = s.engine._round

        def slow(*args, **kwargs):
            time.sleep(0.5)
            return rounds(*args, **kwargs)
        s.engine._round = slow
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{s.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5,
                       json={"model": "tiny", "prompt": "abc", "max_tokens": 64, "stop": ["NEVER"],
                             "ignore_eos": True})
        started = time.time()
        while s.service.in_flight() and time.time() - started < 3:
            time.sleep(0.05)
        assert s.service.in_flight() == 0 and s.service.passes <= 5, s.service.passes
        s.engine._round = rounds
        alone = s.client().completions.create(model="tiny", prompt="abc", max_tokens=64, stop=["NEVER"],
                                              extra_body={"ignore_eos": True}).model_extra["offspec"]["passes"]
        assert alone >= 8
    finally:
        s.close()


def test_a_chunked_body_over_the_cap_is_413(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"a" * 50_000
        yield b'"}'
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, content=chunks())
    assert r.status_code == 413 and r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_a_non_loopback_host_needs_a_key(pair):
    from click.testing import CliRunner

    from offspec.cli.main import main
    r = CliRunner().invoke(main, ["serve", "--target", str(pair[0]), "--host", "0.0.0.0"])
    assert r.exit_code != 0 and "--api-key" in r.output and "Traceback" not in r.output


def test_bench_serve_reports_its_rows():
    """scripts/bench_serve.py's table from rows (no model): tokens/s, the concurrent run against the sequential one
    before it, passes, and how many answers matched."""
    from types import SimpleNamespace

    from scripts_module import load_script
    bench = load_script("bench_serve")
    rows = [dict(way=way, seconds=s, tokens=64, tokens_per_s=64 / s, passes=p, request_passes=rp, texts=texts,
                 repeat=r) for r, (way, s, p, rp, texts) in enumerate([
                     ("one at a time", 16.0, 12, 12, ["a", "b"]), ("all at once", 8.0, 6, 12, ["a", "c"])])]
    text = bench.report(SimpleNamespace(clients=2, dtype="bfloat16", tree_budget=16, new_tokens=32), rows, 0.0,
                        "0 / 0 / 0")
    assert "| all at once | 2 | 8.00 [8.00, 8.00] | 2.00x [2.00, 2.00] | 8.0 | 64 | 6 | 5.33 | 1/2 | 1 |" in text


def test_bench_serve_report_only_states_the_settings_its_rows_were_measured_with(tmp_path, monkeypatch, capsys):
    """--report-only renders the rows measured with its options: rows keep their settings and must equal them; older
    rows (no settings) must have --clients answers of at most --new-tokens tokens, and the section says what they
    were taken as. A compressed --rows is refused by a measuring run before any model loads."""
    import gzip
    import json
    import sys

    from scripts_module import load_script
    bench = load_script("bench_serve")

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["scripts/bench_serve.py", *argv])
        return bench.main()

    settings = dict(clients=2, new_tokens=16, tree_budget=8, dtype="float32", offload="none", context=1024)
    rows = [dict(way=way, seconds=s, tokens=32, tokens_per_s=32 / s, passes=4, request_passes=4, texts=["a", "b"],
                 repeat=0, settings=settings) for way, s in (("one at a time", 8.0), ("all at once", 4.0))]
    other = {**rows[0], "settings": {**settings, "tree_budget": 64}, "tokens_per_s": 99.0}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, other]))
    options = ["--clients", "2", "--new-tokens", "16", "--tree-budget", "8", "--dtype", "float32"]
    assert run(*options, "--rows", str(path), "--report-only") == 0
    text = capsys.readouterr().out
    assert "float32, dyspec at a tree budget of 8, greedy, 16 new tokens" in text and "the 2 prompts" in text
    assert "| one at a time | 2 | 4.00 [" in text and "99.00" not in text and "keep no settings" not in text
    with pytest.raises(SystemExit):                                   # no row measured with a budget of 16
        run(*options[:4], "--tree-budget", "16", "--rows", str(path), "--report-only")
    assert "none of the 3 rows" in capsys.readouterr().err

    older = tmp_path / "older.jsonl"
    older.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "settings"}) + "\n" for r in rows))
    assert run(*options, "--rows", str(older), "--report-only") == 0
    assert "All 2 runs keep no settings" in capsys.readouterr().out

    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    monkeypatch.setattr(bench, "start", lambda args: pytest.fail("a model was loaded"))
    with pytest.raises(InputError, match="is a compressed archive; gunzip it to add rows"):
        run(*options, "--rows", str(packed))


def test_the_offspec_serve_command_answers_a_client(pair, tmp_path):
    """The command itself, as a user starts it: `offspec serve` in its own process, /health, then a streamed chat
    answer with the `openai` client; Ctrl-C (SIGINT) stops it."""
    import signal
    import subprocess
    import sys

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "import sys; from offspec.cli.main import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--target", str(pair[0]), "--draft", str(pair[1]),
                             "--device", "cpu", "--dtype", "float32", "--port", str(port), "--api-key", KEY,
                             "--model-name", "tiny", "--tree-budget", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "OFFSPEC_HOME": str(tmp_path / "home")})
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health").json()["status"] == "ok":
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}],
                                                     max_tokens=8, stream=True))
        assert chunks[-1].usage.completion_tokens > 0
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
    assert f"serving tiny at http://127.0.0.1:{port}/v1" in output and "Traceback" not in output, output
