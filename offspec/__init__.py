"""offspec: run LLMs too big for one GPU, fast — a layer-streamed target verified against dynamic token trees
grown by a resident draft (DySpec), with output exactly the target's own."""
import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# The flat module paths of earlier versions -> where each module lives now, so `from offspec.load import Models`
# in a user's script still imports (the same module object as offspec.engine.load). offspec.jobs, now a package,
# serves its old module's names itself (offspec/jobs/__init__.py).
MOVED = {
    "accept": "spec.accept", "batch": "jobs.prompt_files", "calibrate": "spec.calibrate",
    "checkpoint": "formats.checkpoint", "cluster": "jobs.cluster", "controller": "engine.controller",
    "costmodel": "plan.costmodel", "demo": "formats.demo", "doctor": "cli.doctor", "draft": "model.draft",
    "feed": "engine.feed", "generate": "engine.generate", "gguf_blocks": "formats.gguf_blocks",
    "gguf_read": "formats.gguf_read", "grow": "spec.grow", "hub": "formats.hub", "kv_cache": "model.kv_cache",
    "layout": "formats.layout", "load": "engine.load", "metrics": "engine.metrics", "model_info": "cli.model_info",
    "ngram": "spec.ngram", "options": "plan.options", "prompt": "engine.prompt", "prompt_sets": "bench.prompt_sets",
    "published": "formats.published", "quant": "formats.quant", "request": "engine.request", "ring": "stream.ring",
    "sampling": "spec.sampling", "stores": "stream.stores", "transfer": "stream.transfer", "tree": "spec.tree",
    "vocab": "model.vocab",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `offspec.<old>` as the module now at `offspec.<MOVED[old]>` (one module object under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(__name__ + ".")
        if old in MOVED and old != fullname:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.removeprefix(__name__ + '.')]}")
        spec.loader_state = module.__spec__      # the import system is about to set the old name's spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


sys.meta_path.append(_MovedModule())
