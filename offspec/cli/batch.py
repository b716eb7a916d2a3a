"""`offspec batch`: every prompt of a file, several in flight, each finished one a line of the results file."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import click

from offspec.cli.options import (
    GroupedCommand,
    check_writable,
    model_options,
    models_of,
    open_from_options,
    parse_auto_count,
    run_limits,
    write_report,
)
from offspec.config import SamplingConfig, TreeConfig
from offspec.engine.controller import MIN_JOIN_CHUNK, ROW_GAIN
from offspec.engine.request import check_max_new_tokens
from offspec.errors import InputError
from offspec.plan.search import AUTO_CONCURRENCY


@click.command(cls=GroupedCommand)
@click.argument("prompt_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Results, one JSON line per prompt in the order prompts finish; rerunning skips ids already there.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Default per prompt.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); generation ends before it. Default: none.")
@click.option("--raw", is_flag=True, help="Send prompts as is, without the chat template.")
@click.option("--strict", is_flag=True, help="Stop at the first malformed line instead of skipping it.")
@click.option("--concurrency", default="auto", show_default=True,
              help="Prompts in flight at once (in each worker): every target pass streams the layers once for all "
                   "of them (each with its own tree, KV-cache rows and randomness; outputs are the same as one at a "
                   f"time). auto = the most, up to {AUTO_CONCURRENCY}, that the memory plan fits, and of those only "
                   f"as many as the measured pass and draft costs say add at least {ROW_GAIN:.0%} to tokens/s "
                   "(finished prompts are then not all refilled); 1 = one at a time.")
@click.option("--workers", type=int, default=None,
              help="Run the job on Ray with this many workers, each with its own engine: one GPU each where the "
                   "cluster has GPUs, else --worker-cpus cores each. Needs Ray (pip install -e '.[ray]'). "
                   "Default: no Ray, one engine in this process.")
@click.option("--ray-address", default=None,
              help="With --workers: the Ray cluster to join ('auto' = the one `ray start` runs on this node, or "
                   "HOST:PORT / ray://HOST:PORT). Default: a local Ray started for the job and stopped after it.")
@click.option("--worker-cpus", type=int, default=1, show_default=True,
              help="With --workers: CPU cores each worker claims from Ray (and its torch threads).")
@click.option("--prefill-per-pass", default="auto", show_default=True,
              help="A prompt joining while others decode is fed at most this many tokens a pass, so a long prompt "
                   "does not stall their passes. auto = from measured pass times: a chunk costs the others at most "
                   f"one more pass's fixed cost, and is at least {MIN_JOIN_CHUNK} tokens (whole prompts at once when "
                   "passes are transfer-bound).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the job's totals (tokens/s, passes, prompts per pass, GB per token; per worker with "
                   "--workers) here. Default: none.")
@model_options
def batch(prompt_file, output, max_new_tokens, stop, raw, strict, concurrency, prefill_per_pass, workers,
          ray_address, worker_cpus, json_path, **o):
    """Run every prompt of PROMPT_FILE (.txt: one per line; .jsonl: {id, prompt | messages, max_new_tokens?},
    or OpenAI batch lines {custom_id, body: {messages, max_tokens, temperature, top_p, stop, seed}}, whose
    results are in OpenAI's batch output shape).

    --concurrency prompts are in flight at once, sharing every target pass; each prompt's output is what it
    would be alone. Each finished prompt is one complete line in OUTPUT; Ctrl-C (exit 130) or a kill loses
    no finished line, and rerunning the same command continues where it stopped. --workers N shards the job
    over N Ray workers (docs/cluster.md); this process stays the only writer of OUTPUT."""
    from offspec.jobs.prompt_files import ResultFile
    from offspec.jobs.runner import BatchRun

    check_max_new_tokens(max_new_tokens, "--max-new-tokens")
    concurrency = parse_auto_count(concurrency, "--concurrency", 1)
    prefill_per_pass = parse_auto_count(prefill_per_pass, "--prefill-per-pass", 1)
    ray = ray_for(workers, worker_cpus, ray_address)
    if json_path:
        check_writable(json_path)
    items, bad = read_items(prompt_file, strict)
    results = ResultFile(output)
    try:
        todo = [it for it in items if it.id not in results.done]
        if len(todo) < len(items):
            click.echo(f"resuming: {len(items) - len(todo)} of {len(items)} prompts already in {output}", err=True)
        if not todo:
            click.echo("nothing to do", err=True)
            return
        models, (runtime, offload, tree, sampling) = open_from_options(o, check_device=workers is None)
        skips = Skips(prompt_file, strict)
        requests = encode_requests(models.tokenizer, todo, Defaults(raw, stop, max_new_tokens, tree, sampling), skips)
        longest = max(len(r.prompt_ids) + r.max_new_tokens for _, r in requests)
        samples = any(not r.sampling.greedy for _, r in requests)     # an OpenAI line may set its own temperature
        limits = run_limits(o, tree, samples, longest, concurrency, prompts=len(requests))
        run = BatchRun(models, offload, runtime, limits, prefill_per_pass, [r for _, r in requests])
        job = run_job(run, requests, results, output, skips, RayOptions(ray, workers, worker_cpus, ray_address, o))
    finally:
        results.close()
    job.skipped = len(bad) + skips.failed
    report_job(job, output)
    if json_path:
        write_report(json_path, job.to_dict(), *models_of(models))
    if skips.failed or bad:
        sys.exit(2 if job.prompts == 0 else 0)


def ray_for(workers: Optional[int], worker_cpus: int, ray_address: Optional[str]):
    """Ray, imported, where --workers asks for it (else None); the Ray options checked."""
    from offspec.jobs.cluster import import_ray

    if workers is None:
        if ray_address is not None:
            raise InputError("--ray-address needs --workers")
        return None
    if workers < 1 or worker_cpus < 1:
        raise InputError("--workers and --worker-cpus must be at least 1")
    return import_ray()


def read_items(prompt_file: str, strict: bool) -> tuple[list, list]:
    """The prompt file's valid items and its malformed lines, each said on stderr (--strict: the first stops)."""
    from offspec.jobs.prompt_files import read_prompt_file

    items, bad = read_prompt_file(prompt_file)
    for b in bad:
        if strict:
            raise InputError(f"{prompt_file}: {b}")
        click.echo(f"offspec: skipping {prompt_file} {b}", err=True)
    if not items:
        nothing_valid(f"{prompt_file}: no valid prompt found (all {len(bad)} lines were skipped)")
    return items, bad


@dataclass
class Skips:
    """The prompts of a job that cannot run: counted, each a line on stderr; with --strict the job stops there."""
    prompt_file: str
    strict: bool
    failed: int = 0

    def line(self, item, e) -> str:
        """The line for a prompt that cannot run."""
        if self.strict:
            raise InputError(f"{self.prompt_file} line {item.line}: {e}") from None
        self.failed += 1
        return f"offspec: skipping {self.prompt_file} line {item.line} (id {item.id}): {e}"


@dataclass(frozen=True)
class Defaults:
    """What a prompt line does not say for itself: the command's options."""
    raw: bool
    stop: tuple[str, ...]
    max_new_tokens: int
    tree: TreeConfig
    sampling: SamplingConfig


def encode_requests(tokenizer, todo: list, defaults: Defaults, skips: Skips) -> list:
    """[(item, GenerationRequest)] for every prompt that encodes. Every prompt is tokenized before loading: the
    longest one sizes the KV caches (--context auto)."""
    from offspec.engine.generate import GenerationRequest
    from offspec.engine.prompt import encode_prompt

    requests = []
    for item in todo:
        try:
            ids = encode_prompt(tokenizer, item.prompt, raw=defaults.raw)
            request = GenerationRequest(prompt_ids=tuple(ids), stop_strings=item.stop_strings(defaults.stop),
                                        max_new_tokens=item.max_new_tokens or defaults.max_new_tokens,
                                        tree=defaults.tree, sampling=item.sampling(defaults.sampling))
            requests.append((item, request))
        except InputError as e:
            click.echo(skips.line(item, e), err=True)
    if not requests:
        nothing_valid(f"{skips.prompt_file}: no prompt could be encoded ({skips.failed} skipped)")
    return requests


@dataclass(frozen=True)
class RayOptions:
    """--workers and what places them (ray: the imported module, None for no Ray)."""
    ray: object
    workers: Optional[int]
    worker_cpus: int
    ray_address: Optional[str]
    o: dict               # the model options (device, draft_quant, target, draft)


def run_job(run, requests: list, results, output: str, skips: Skips, options: RayOptions):
    """Every request through one engine here, or through Ray workers; each finished one written to results
    (OUTPUT's ResultFile) -> the JobReport."""
    from tqdm import tqdm

    from offspec.jobs.cluster import RaySetup, engines_on_ray
    from offspec.jobs.runner import engine_here, write_results

    if options.ray is None:
        source = engine_here(run)
    else:
        o = options.o
        setup = RaySetup(options.workers, options.worker_cpus, options.ray_address,
                         device=o["device"] if device_given() else None, draft_quant=o["draft_quant"],
                         target=o["target"], draft=o["draft"])
        source = engines_on_ray(run, setup, options.ray,
                                notify=lambda text: tqdm.write(f"offspec: {text}", file=sys.stderr))
    with source as running:
        if running.where:
            click.echo(running.where, err=True)
        try:
            write_results(running, requests, results, skips.line)
        except KeyboardInterrupt:
            click.echo(f"\noffspec: interrupted; finished prompts are saved in {output}; rerun to resume", err=True)
            sys.exit(130)
    return running.report


def report_job(job, output: str) -> None:
    """The job's totals on stderr: the summary, where its passes' time went, one line per worker."""
    click.echo(f"{job.summary()}; results in {output}", err=True)
    if job.passes:
        click.echo(job.pass_line(), err=True)
    for worker in job.workers:
        click.echo(f"  {worker.line()}", err=True)


def device_given() -> bool:
    """--device was given on the command line (else its default: this machine's, which a Ray worker's is not)."""
    return click.get_current_context().get_parameter_source("device") != click.core.ParameterSource.DEFAULT


def nothing_valid(message: str) -> None:
    """A job with nothing valid to run failed: one line, exit 2 (as when no prompt ran at all)."""
    click.echo(f"offspec: error: {message}", err=True)
    sys.exit(2)
