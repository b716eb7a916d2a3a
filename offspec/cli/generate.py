"""`offspec generate`: one prompt, its text streamed to stdout as it is made."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from offspec.cli.options import (
    GroupedCommand,
    check_writable,
    model_options,
    models_of,
    open_from_options,
    run_limits,
    write_report,
)
from offspec.engine.request import check_max_new_tokens, check_text
from offspec.errors import InputError


@click.command(cls=GroupedCommand)
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None,
              help="Read the prompt from this file ('-' = stdin). Default: the PROMPT argument, else stdin.")
@click.option("--raw", is_flag=True, help="Send the text as is, without the chat template.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Stop after this many tokens.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); generation ends before it. Default: none.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the full report (tokens, text, timings) to this JSON file. Default: none.")
@click.option("--quiet", is_flag=True, help="Print only the generated text (no report on stderr).")
@model_options
def generate(prompt, prompt_file, raw, max_new_tokens, stop, json_path, quiet, **o):
    """Generate text for PROMPT (or --prompt-file, or stdin)."""
    from offspec.engine.generate import GenerationRequest, run
    from offspec.engine.prompt import encode_prompt

    text = read_prompt(prompt, prompt_file)
    check_max_new_tokens(max_new_tokens, "--max-new-tokens")
    if json_path:
        check_writable(json_path)
    models, (runtime, offload, tree, sampling) = open_from_options(o)
    ids = encode_prompt(models.tokenizer, text, raw=raw)
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=max_new_tokens, stop_strings=tuple(stop),
                                tree=tree, sampling=sampling)
    loaded = models.load(offload, runtime, run_limits(o, tree, not sampling.greedy, len(ids) + max_new_tokens))

    def on_text(delta):
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        report, _ = run(loaded.engine, request, start=loaded.start, on_text=on_text)
    finally:
        loaded.engine.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        click.echo(report.summary(), err=True)
    if json_path:
        write_report(json_path, report.to_dict(), *models_of(models))


def read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
    if prompt is not None and prompt_file is not None:
        raise InputError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = sys.stdin.read() if prompt_file == "-" else Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read prompt file {prompt_file}: {e}") from None
    elif prompt is not None:
        text = prompt
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise InputError("no prompt: give one as an argument, with --prompt-file, or on stdin")
    check_text(text, where=prompt_file if prompt_file != "-" else None)
    return text
