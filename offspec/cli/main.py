"""The `offspec` command: the group that generate, batch, bench, serve, doctor and models (demo, info, prepare) join.

Thin by design: options map one to one onto the config dataclasses; known failures (OffspecError, and OS
errors such as a full disk) become one line on stderr, `offspec: error: ...`, and exit code 1; Ctrl-C exits
with 130. Every command that loads models closes the engine (the streamer's threads) on the way out.
"""
from __future__ import annotations

import errno
import sys

import click

from offspec.cli.batch import batch
from offspec.cli.bench import bench
from offspec.cli.doctor import doctor
from offspec.cli.generate import generate
from offspec.cli.models import models
from offspec.cli.options import fail, known_cause
from offspec.cli.serve import serve
from offspec.errors import OffspecError


class OffspecGroup(click.Group):
    """Turns known failures into one line and exit 1; Ctrl-C into exit 130 without a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\noffspec: interrupted", err=True)
            sys.exit(130)
        except click.exceptions.Exit:
            raise
        except Exception as e:
            cause = known_cause(e)
            if isinstance(cause, OSError) and cause.errno == errno.EPIPE:
                raise                       # click quiets a closed pipe (`offspec generate ... | head`) itself
            if isinstance(cause, OffspecError):
                fail(str(cause))
            if isinstance(cause, OSError):
                fail(f"{cause.strerror or cause}" + (f": {cause.filename}" if cause.filename else ""))
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(e, torch.OutOfMemoryError):
                fail(f"out of device memory ({str(e).splitlines()[0]}); lower --gpu-budget or --tree-budget, "
                     "or offload the target (--offload cpu|disk)")
            raise


@click.group(cls=OffspecGroup)
@click.version_option(package_name="offspec")
def main():
    """offspec: run LLMs too big for one GPU, fast. The target's layers stream from host RAM or disk
    through the device; a resident draft grows token trees that one target pass verifies. Output is
    exactly the target's own (greedy), or has exactly its distribution (sampling)."""


main.add_command(generate)
main.add_command(batch)
main.add_command(serve)
main.add_command(bench)
main.add_command(doctor)
main.add_command(models)


if __name__ == "__main__":
    main()
