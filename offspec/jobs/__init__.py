"""Many prompts through one engine: the job runner, prompt and result files, Ray workers."""
import importlib


def __getattr__(name):
    """offspec.jobs was the job runner's module: `from offspec.jobs import run_prompts` still imports its names."""
    runner = importlib.import_module("offspec.jobs.runner")
    try:
        return getattr(runner, name)
    except AttributeError:
        raise AttributeError(f"module 'offspec.jobs' has no attribute {name!r}") from None
