"""`offspec serve`: the target (with its draft) behind the OpenAI HTTP API."""
from __future__ import annotations

from pathlib import Path

import click

from offspec.cli.options import GroupedCommand, model_options, open_from_options, parse_auto_count, run_limits
from offspec.engine.request import check_max_new_tokens
from offspec.errors import InputError
from offspec.plan.search import AUTO_CONCURRENCY

SERVE_CONTEXT = 4096      # --context auto for a server: tokens a request may reach (capped at the models' context)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command(cls=GroupedCommand)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Another than this machine's loopback needs --api-key (or --no-key-ok).")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port.")
@click.option("--api-key", envvar="OFFSPEC_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on every route but /health. Default: $OFFSPEC_API_KEY, else "
                   "none.")
@click.option("--no-key-ok", is_flag=True, help="Listen on a non-loopback --host without an API key (anyone who "
              "reaches the port can use the model).")
@click.option("--model-name", default=None, help="The model name clients send and /v1/models lists. Default: the "
              "target's folder or file name.")
@click.option("--concurrency", default="auto", show_default=True,
              help=f"Requests in flight at once, sharing every target pass (each with its own tree, KV-cache rows "
                   f"and randomness; each answer is what it would be alone). auto = the most, up to "
                   f"{AUTO_CONCURRENCY}, that the memory plan fits.")
@click.option("--max-waiting", type=int, default=64, show_default=True,
              help="Requests that may wait for a free row; one more is answered 429 with Retry-After.")
@click.option("--max-tokens", type=int, default=2048, show_default=True,
              help="The most new tokens a request may ask for (max_tokens), and what one that asks for none gets "
                   "(both capped by the context).")
@click.option("--shutdown-timeout", type=float, default=30.0, show_default=True,
              help="Seconds SIGTERM or Ctrl-C waits for the answers in flight to close (each ends at once with a "
                   "last chunk holding what it has) before the connections are dropped.")
@click.option("--access-log", type=click.Choice(["info", "warning", "off"]), default="info", show_default=True,
              help="One line a request (client, method, path, status, seconds; never the prompt or the key) at this "
                   "log level, on stderr.")
@model_options
def serve(host, port, api_key, no_key_ok, model_name, concurrency, max_waiting, max_tokens, shutdown_timeout,
          access_log, **o):
    """Serve the target (with its draft) over the OpenAI HTTP API: POST /v1/chat/completions and /v1/completions
    (streaming or not), GET /v1/models, /health and /metrics (Prometheus). Requests in flight share every target
    pass; a request waits for a free row at most --max-waiting deep. SIGTERM or Ctrl-C ends every answer in flight
    with a last chunk, then stops; an engine failure answers 500 and exits 1, for a supervisor to restart. Needs the
    serve extra: pip install -e ".[serve]". Supported fields, errors, limits: docs/serving.md."""
    if api_key is not None and not api_key.strip():
        raise InputError("--api-key (or $OFFSPEC_API_KEY) is empty: give a key, or leave it out")
    if host not in LOOPBACK and api_key is None and not no_key_ok:
        raise InputError(f"--host {host} listens beyond this machine: give --api-key (or $OFFSPEC_API_KEY), or "
                         f"--no-key-ok to let anyone who reaches port {port} use the model")
    if max_waiting < 0 or max_tokens < 1 or shutdown_timeout < 0:
        raise InputError("--max-waiting and --shutdown-timeout must be at least 0 and --max-tokens at least 1")
    check_max_new_tokens(max_tokens, "--max-tokens")
    import importlib.util
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"offspec serve needs FastAPI and uvicorn ({', '.join(missing)} missing): "
                         f'pip install -e ".[serve]"')
    from offspec.serve.app import EngineService, ServeConfig, make_app

    concurrency = parse_auto_count(concurrency, "--concurrency", 1)
    if o["context"] == "auto":
        o = {**o, "context": str(SERVE_CONTEXT)}
    models, (runtime, offload, tree, sampling) = open_from_options(o)
    limits = run_limits(o, tree, True, SERVE_CONTEXT, concurrency, prompts=None)
    loaded = models.load(offload, runtime, limits)
    failed: list[str] = []
    service = EngineService(loaded.engine, loaded.plan.concurrency, max_waiting)
    name = model_name or Path(str(models.target.path)).name
    cfg = ServeConfig(model=name, tree=tree, sampling=sampling, max_tokens=min(max_tokens, loaded.plan.context - 2),
                      max_waiting=max_waiting, context=loaded.plan.context, api_key=api_key, loopback=host in LOOPBACK,
                      access_log=access_log)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"offspec: serving {name} at http://{shown}:{port}/v1 ({loaded.plan.concurrency} requests in flight, "
               f"context {loaded.plan.context} tokens; {loaded.plan.layers_line()})", err=True)
    server = draining_server(make_app(service, cfg, models.tokenizer), service, host, port, shutdown_timeout,
                             connections=loaded.plan.concurrency + max_waiting + 32)

    def engine_failed(failure: str) -> None:        # (on the engine's thread)
        failed.append(failure)
        server.should_exit = True                   # uvicorn's loop sees it within 0.1 s

    service.on_failure = engine_failed
    try:
        server.run()
    finally:
        service.close()
    if failed:
        raise InputError(f"the engine failed ({failed[0]}): the requests in flight were answered 500 and the server "
                         f"stopped, for a supervisor to restart it")


def draining_server(app, service, host: str, port: int, shutdown_timeout: float, connections: int):
    """uvicorn's server whose SIGTERM / SIGINT first drains the service (new requests 503, every answer in flight
    ended with a last chunk), then closes within shutdown_timeout; at most `connections` connections at once (more
    get 503), idle keep-alive connections closed after 5 s. The access lines go to stderr."""
    import logging
    import sys

    import uvicorn

    access = logging.getLogger("offspec.access")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("offspec: %(asctime)s %(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame):
            service.drain()
            super().handle_exit(sig, frame)

    return Draining(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=shutdown_timeout, limit_concurrency=connections,
                                   timeout_keep_alive=5))
