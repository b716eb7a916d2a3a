"""Import a benchmark script of scripts/ as a module, for tests of its model-free parts."""
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py (or scripts/devtools/<name>.py) as module `name`, registered in sys.modules (its dataclasses look their module up there).
    scripts/ goes on sys.path, as when a script runs, so it can import its siblings (_common, _stats)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    path = next(p for p in (SCRIPTS / f"{name}.py", SCRIPTS / "devtools" / f"{name}.py") if p.is_file())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
