"""docs/architecture.md's blocks are what offspec imports of itself, read with ast: every `import offspec.x`,
`from offspec.x import y`, `from .x import y` and `from . import x`, at module level or inside a function. The
stages block says which stage (a subpackage, or config / errors) imports which; the imports block, module by module.

    python tests/test_architecture.py      reprints both blocks from the code, to paste into docs/architecture.md
"""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offspec"
DOC = ROOT / "docs" / "architecture.md"
BLOCK = re.compile(r"^```imports\n(.*?)^```", re.MULTILINE | re.DOTALL)   # the fenced blocks the doc holds
STAGES = re.compile(r"^```stages\n(.*?)^```", re.MULTILINE | re.DOTALL)


def module_name(path: Path) -> str:
    """offspec/config.py -> "config"; offspec/stream/ring.py -> "stream.ring"; offspec/stream/__init__.py -> "stream"."""
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
    return {name: deps for name, deps in graph.items() if deps or paths[name].name != "__init__.py"}


def format_block(graph: dict[str, set[str]]) -> str:
    return "".join(f"{m} -> {', '.join(sorted(graph[m]))}".rstrip() + "\n" for m in sorted(graph))


def stage(module: str) -> str:
    """"stream.ring" -> "stream"; "config" -> "config"."""
    return module.split(".")[0]


def stage_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{stage: the other stages its modules import}."""
    stages = {stage(m): set() for m in graph}
    for module, deps in graph.items():
        stages[stage(module)] |= {stage(d) for d in deps} - {stage(module)}
    return stages


def documented_imports(block: re.Pattern = BLOCK) -> dict[str, set[str]]:
    """The doc's block (imports, or STAGES) as {name: the names after its arrow}."""
    found = block.search(DOC.read_text(encoding="utf-8"))
    assert found, f"{DOC.relative_to(ROOT)} lacks a block: {block.pattern}"
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


def test_the_architecture_doc_lists_which_stage_imports_which():
    doc, code = documented_imports(STAGES), stage_imports(real_imports())
    wrong = [f"{s}: the doc says {', '.join(sorted(doc.get(s, ()))) or 'nothing'}; the code imports "
             f"{', '.join(sorted(code.get(s, ()))) or 'nothing'}" for s in sorted(doc.keys() | code.keys())
             if doc.get(s) != code.get(s)]
    assert not wrong, ("docs/architecture.md's stages block differs from the code (reprint it with "
                       "`python tests/test_architecture.py`; a new arrow between stages is a design decision: say "
                       "why in the doc):\n" + "\n".join(wrong))


def assert_one_way(graph: dict[str, set[str]], what: str) -> None:
    """No loop in graph ({name: the names it imports}): depth first, failing on an edge back into the path."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            assert state.get(dep) != 1, f"{what} import each other: " + " -> ".join([*path, name, dep])
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_stages_import_one_way():
    """Stages form a pipeline: no two stages import each other, directly or round a loop."""
    assert_one_way(stage_imports(real_imports()), "stages")


def test_the_package_has_no_import_cycle():
    """No two modules import each other, directly or round a loop, at module level or inside a function (an
    import in a function that points back is a circle too: the two modules are one job split wrong)."""
    assert_one_way(real_imports(), "modules")




def test_the_plan_imports_nothing_that_streams_or_runs():
    """The memory plan is arithmetic over shapes and the machine (docs/architecture.md)."""
    assert stage_imports(real_imports())["plan"] <= {"config", "errors", "formats"}


def test_the_formats_import_nothing_of_the_engine():
    """Reading model files needs no tree, plan, stream or engine: formats/ imports only config and errors."""
    assert stage_imports(real_imports())["formats"] <= {"config", "errors"}


def test_speculation_imports_no_model():
    """Trees, acceptance and sampling are tensor code: spec/ imports only config."""
    assert stage_imports(real_imports())["spec"] <= {"config"}


def test_no_module_is_longer_than_a_module_should_be():
    """One job a module: none above 500 lines."""
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"


def test_the_flat_paths_of_earlier_versions_still_import():
    """`from offspec.load import Models` (the README's library calls before the stages) still works: the same
    module object as its new path."""
    import importlib

    import offspec

    for old, new in offspec.MOVED.items():
        assert importlib.import_module(f"offspec.{old}") is importlib.import_module(f"offspec.{new}"), old
    from offspec.engine.feed import RequestFeed
    from offspec.jobs import run_prompts
    from offspec.jobs.runner import run_prompts as runner_run_prompts

    assert run_prompts is runner_run_prompts
    assert importlib.import_module("offspec.feed").RequestFeed is RequestFeed


if __name__ == "__main__":
    graph = real_imports()
    sys.stdout.write("```stages\n" + format_block(stage_imports(graph)) + "```\n\n")
    sys.stdout.write("```imports\n" + format_block(graph) + "```\n")
