"""`offspec bench`: systems measured side by side on one loaded engine, with medians and intervals."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

import click

from offspec.cli.options import (
    GroupedCommand,
    check_writable,
    model_options,
    models_of,
    open_from_options,
    parse_context,
    warn,
    write_report,
)
from offspec.config import TreeConfig
from offspec.errors import InputError


@click.command(cls=GroupedCommand)
@click.argument("prompt_file", type=click.Path(dir_okay=False))
@click.option("--systems", default="default,none", show_default=True,
              help="Comma-separated systems, all on one loaded engine: default (the tree options given), none "
                   "(plain autoregressive), or <policy>-<N>, a policy at a fixed budget of N nodes (chain-8, "
                   "dyspec-16: the ablations a default is judged against). Speedups are over none.")
@click.option("--prompt-tokens", type=int, default=128, show_default=True, help="Cut each prompt to this many tokens.")
@click.option("--new-tokens", type=int, default=128, show_default=True,
              help="Tokens generated per prompt (EOS ignored).")
@click.option("--temperatures", default="0,0.6", show_default=True, help="Comma-separated temperatures to run.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Timed runs per system and prompt, in an order drawn per prompt and repeat; a prompt's s/token is "
                   "their median.")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts. Default: all.")
@click.option("--rows", "rows_path", type=click.Path(dir_okay=False), default=None,
              help="Append each prompt's row to this JSONL file as it is measured; a rerun with the same options "
                   "measures only the (prompt, temperature) rows it lacks and summarizes those of its prompts, "
                   "temperatures and systems (rows measured with other options stop it). Default: none.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the summary and every row to this JSON file. Default: none.")
@model_options
def bench(prompt_file, systems, prompt_tokens, new_tokens, temperatures, repeats, limit, rows_path, json_path, **o):
    """Systems measured side by side on one engine, loaded as generate loads it: the same prompts, a fixed
    number of new tokens (EOS ignored, the Sequoia/DySpec protocol), interleaved per prompt, with medians and
    bootstrap 95% intervals over prompts. A system's s/token is its wall time over its tokens, prefill included."""
    from offspec.bench import runner as b

    temps, names = check_bench_options(systems, prompt_tokens, new_tokens, temperatures, repeats, limit, o)
    for path in (rows_path, json_path):
        if path:
            check_writable(path)
    b.check_appendable(rows_path)
    items = read_bench_prompts(prompt_file, limit)
    models, (runtime, offload, tree, sampling) = open_from_options(o, need_draft=True)
    trees = {name: b.system_tree(name, tree) for name in names}
    prompts = b.bench_prompts(models.tokenizer, items, prompt_tokens)
    settings = json.loads(json.dumps({
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats, "tree": vars(tree),
        "models": [str(p) for p in models_of(models)], "device": str(runtime.device), "dtype": o["dtype"],
        "offload": o["offload"], "target_quant": o["target_quant"], "draft_quant": o["draft_quant"]}))
    rows = b.resumed_rows(rows_path, prompts, trees, temps, sampling.seed, settings, warn)
    if len(rows) < len(prompts) * len(temps):
        longest = max(len(ids) for _, ids in prompts) + new_tokens
        limits = b.bench_limits(trees.values(), longest, any(t > 0 for t in temps))
        limits = replace(limits, context=parse_context(o["context"]) or limits.context,
                         prefill_chunk=o["prefill_chunk"])
        loaded = models.load(offload, runtime, limits)
        setup = {"settings": settings, "plan": {"offload": loaded.plan.mode, "target_quant": loaded.plan.target_quant,
                                                "draft_quant": runtime.draft_quant}}
        try:
            rows += measure_bench(loaded.engine, prompts, trees, sampling, temps, new_tokens, repeats,
                                  {b.row_key(r) for r in rows}, rows_path, setup)
        finally:
            loaded.engine.close()
    report = []
    for t in temps:
        summary = b.summarize([r for r in rows if r["temperature"] == t])
        click.echo(f"temperature {t:g}:\n{b.format_table(summary)}")
        report += [{"temperature": t, **s} for s in summary]
    if json_path:
        write_report(json_path, {"summary": report, "rows": rows}, *models_of(models))


def check_bench_options(systems, prompt_tokens, new_tokens, temperatures, repeats, limit, o) -> tuple[list, list]:
    """(temperatures, system names) checked before any model is opened."""
    from offspec.bench import runner as b

    temps = b.parse_temperatures(temperatures)
    if prompt_tokens < 1 or new_tokens < 1 or repeats < 1:
        raise InputError("--prompt-tokens, --new-tokens and --repeats must be at least 1")
    if limit is not None and limit < 1:
        raise InputError("--limit must be at least 1")
    names = list(dict.fromkeys(x.strip() for x in systems.split(",") if x.strip()))
    for name in names:
        b.system_tree(name, TreeConfig())       # an unknown name fails here
    if b.PLAIN not in names or len(names) < 2:
        raise InputError(f"--systems must name {b.PLAIN} (the speedups' reference) and at least one other system")
    if o["policy"] == "none":
        raise InputError("bench compares against a tree policy; choose one with --tree")
    return temps, names


def read_bench_prompts(prompt_file: str, limit: Optional[int]):
    from offspec.jobs.prompt_files import read_prompt_file

    items, bad = read_prompt_file(prompt_file)
    for line in bad:
        click.echo(f"offspec: skipping {prompt_file} {line}", err=True)
    if not items:
        raise InputError(f"{prompt_file}: no usable prompts")
    return items[:limit] if limit else items


def measure_bench(engine, prompts, trees: dict, sampling, temps, new_tokens: int, repeats: int, done: set,
                  rows_path: Optional[str], setup: dict) -> list[dict]:
    """The rows `done` lacks, each printed (and appended to rows_path) as it is made."""
    from offspec.bench import runner as b

    def on_row(row):
        if rows_path:
            b.append_row(rows_path, row)
        click.echo(f"T={row['temperature']:g} {row['id']}: " + ", ".join(
            f"{name} {cell['seconds_per_token']:.4f} s/token, {cell['tokens_per_pass']:.2f} tokens/pass"
            for name, cell in row["systems"].items()), err=True)

    rows = []
    for t in temps:
        s = replace(sampling, temperature=t)
        runners = {name: b.offspec_runner(engine, tree, s, ignore_eos=True) for name, tree in trees.items()}
        rows += b.measure(prompts, runners, new_tokens, temperature=t, seeds=(None,) if t == 0 else (sampling.seed,),
                          repeats=repeats, done=done, on_row=on_row, extra=setup)
    return rows
