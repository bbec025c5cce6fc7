"""The import graph of the package and of the tests that use it: no module imports another
module's private name, and the command's modules (gradaccum.app) import each other without a
circle, counting the imports inside functions too (only imports under TYPE_CHECKING, which
never run, are left out)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def module_name(file: Path) -> str:
    parts = list(file.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in (SRC / "gradaccum").rglob("*.py")}
CHECKED = [
    *sorted((SRC / "gradaccum").rglob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
    *sorted((ROOT / "bench").glob("*.py")),
    *sorted((ROOT / "examples").glob("*.py")),
]


def run_imports(tree: ast.AST):
    """Every import statement that runs (not those under ``if TYPE_CHECKING:``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from run_imports(node)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(file: Path) -> list[str]:
    found = []
    for node in run_imports(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradaccum"):
            found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
            found += [node.module] if any(map(private, node.module.split("."))) else []
    return found


def test_no_module_imports_another_modules_private_name():
    found = {str(f.relative_to(ROOT)): private_imports(f) for f in CHECKED}
    assert {f: names for f, names in found.items() if names} == {}


def edges(module: str, file: Path) -> set[str]:
    """The package's modules ``module`` imports (``from pkg import sub`` names ``pkg.sub``)."""
    out = set()
    for node in run_imports(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= subs | ({node.module} if len(subs) < len(node.names) else set())
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
    return out - {module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_commands_modules_import_each_other_without_a_circle():
    app = {m: f for m, f in MODULES.items() if m.startswith("gradaccum.app")}
    graph = {m: edges(m, f) & app.keys() for m, f in app.items()}
    assert circles(graph) == []


def test_the_checks_see_a_private_import_and_a_circle(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from gradaccum.app.trainer import _x\n")
    assert private_imports(bad) == ["gradaccum.app.trainer._x"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
