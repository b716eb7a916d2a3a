"""docs/architecture.md's import block is what offspec's modules import of each other, read with ast: every
`import offspec.x`, `from .x import y` and `from . import x`, at module level or inside a function.

    python tests/test_architecture.py      reprints the block from the code, to paste into docs/architecture.md
"""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offspec"
DOC = ROOT / "docs" / "architecture.md"
BLOCK = re.compile(r"^```imports\n(.*?)^```", re.MULTILINE | re.DOTALL)   # the fenced block the doc holds


def module_name(path: Path) -> str:
    """offspec/stream/ring.py -> "ring"; offspec/offload/ring.py -> "offload.ring"; offspec/offload/__init__.py -> "offload"."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imported(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The offspec modules a module's code imports (by their names relative to offspec/)."""
    # The package a relative import starts from: a module's own package, a package's __init__ itself.
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("offspec.") for a in node.names if a.name.startswith("offspec.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module is None or not (node.module + ".").startswith("offspec."):
                    continue
                base = node.module.removeprefix("offspec").lstrip(".").split(".")
            else:
                base = here[:len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            base = [p for p in base if p]
            for alias in node.names:   # `from .pkg import module` names a module; `from .module import name` not
                sub = ".".join([*base, alias.name])
                found.add(sub if sub in modules else ".".join(base))
    return {m for m in found if m in modules and m != name}


def real_imports() -> dict[str, set[str]]:
    """{module: the offspec modules it imports} for every module under offspec/ (the package's own __init__ only
    when it imports one)."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    modules = set(paths)
    graph = {name: imported(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", modules)
             for name, path in paths.items()}
    if not graph.get("__init__"):
        graph.pop("__init__", None)
    return graph


def format_block(graph: dict[str, set[str]]) -> str:
    return "".join(f"{m} -> {', '.join(sorted(graph[m]))}".rstrip() + "\n" for m in sorted(graph))


def documented_imports() -> dict[str, set[str]]:
    found = BLOCK.search(DOC.read_text(encoding="utf-8"))
    assert found, f"{DOC.relative_to(ROOT)} has no ```imports block"
    graph = {}
    for line in found.group(1).splitlines():
        if not line.strip():
            continue
        module, arrow, deps = line.partition("->")
        assert arrow, f"not `module -> dep, dep`: {line!r}"
        graph[module.strip()] = {d.strip() for d in deps.split(",") if d.strip()}
    return graph


def test_the_architecture_doc_lists_the_imports_as_they_are():
    doc, code = documented_imports(), real_imports()
    lines = []
    for module in sorted(doc.keys() | code.keys()):
        if module not in code:
            lines.append(f"{module}: in the doc, but offspec has no such module")
        elif module not in doc:
            lines.append(f"{module}: missing from the doc; it imports: {', '.join(sorted(code[module])) or 'nothing'}")
        elif doc[module] != code[module]:
            added, gone = code[module] - doc[module], doc[module] - code[module]
            lines.append(f"{module}: " + "; ".join(
                part for part in (f"imports {', '.join(sorted(added))} (not in the doc)" if added else "",
                                  f"no longer imports {', '.join(sorted(gone))}" if gone else "") if part))
    assert not lines, ("docs/architecture.md's import block differs from the code (reprint it with "
                       "`python tests/test_architecture.py`):\n" + "\n".join(lines))


def test_the_plan_imports_no_streaming_code():
    """The memory plan is arithmetic over shapes and the machine (docs/architecture.md)."""
    assert not real_imports()["plan"] & {"ring", "stores", "transfer"}


def test_the_package_has_no_import_cycle_at_module_level():
    """Every module can be imported on its own: no cycle among module-level imports (function-level imports
    may point back; they run after both modules are loaded)."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    modules = set(paths)
    top = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # The import statements directly in the module's body: what importing it runs (not those in functions,
        # nor under `if TYPE_CHECKING:`).
        body = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
        top[name] = imported(body, name, path.name == "__init__.py", modules)
    state: dict[str, int] = {}          # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(top[module]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(top):
        if module not in state:
            visit(module, [])


if __name__ == "__main__":
    sys.stdout.write("```imports\n" + format_block(real_imports()) + "```\n")
