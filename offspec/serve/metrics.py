"""GET /metrics: the server's counters in Prometheus' text format (version 0.0.4), as vLLM's and llama.cpp's
servers expose theirs. Every series carries the served model's name."""
from __future__ import annotations

METRICS = (   # (name, type, help)
    ("offspec_requests_total", "counter", "HTTP requests answered, by status"),
    ("offspec_rows_in_flight", "gauge", "requests the engine is running (each on its row of every pass)"),
    ("offspec_queue_depth", "gauge", "requests waiting for a row"),
    ("offspec_generated_tokens_total", "counter", "tokens generated"),
    ("offspec_target_passes_total", "counter", "target passes run (a pass shared by several rows counted once)"),
    ("offspec_target_pass_seconds_total", "counter", "seconds of those target passes"),
    ("offspec_tokens_per_pass", "gauge", "tokens generated per target pass, since the start"),
    ("offspec_engine_up", "gauge", "1 while the engine runs, 0 once it has failed"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(service, model: str) -> str:
    counters, held, waiting = service.snapshot()
    m = f'model="{_label(model)}"'
    values = {
        "offspec_requests_total": [(f'{m},status="{status}"', n) for status, n in sorted(counters.requests.items())],
        "offspec_rows_in_flight": [(m, held - waiting)],
        "offspec_queue_depth": [(m, waiting)],
        "offspec_generated_tokens_total": [(m, counters.tokens)],
        "offspec_target_passes_total": [(m, round(counters.passes, 6))],
        "offspec_target_pass_seconds_total": [(m, round(counters.pass_seconds, 6))],
        "offspec_tokens_per_pass": [(m, round(counters.tokens / counters.passes, 4) if counters.passes else 0)],
        "offspec_engine_up": [(m, 0 if service.failure else 1)],
    }
    lines = []
    for name, kind, text in METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{labels}}} {value}" for labels, value in values[name]]
    return "\n".join(lines) + "\n"
