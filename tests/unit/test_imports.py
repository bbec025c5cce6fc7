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


# -- the library knows neither the frameworks nor the command --------------------------------

FRAMEWORKS = {
    "lightning",
    "pytorch_lightning",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "deepspeed",
    "sentence_transformers",
}
LIBRARY = {
    m: f for m, f in MODULES.items() if m != "gradaccum.app" and not m.startswith("gradaccum.app.")
}


def framework_imports(file: Path) -> list[str]:
    """The frameworks ``file`` imports, anywhere in it (inside functions too)."""
    found = []
    for node in run_imports(ast.parse(file.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        if isinstance(node, ast.ImportFrom) and node.level:
            continue
        found += [n for n in names if n and n.split(".")[0] in FRAMEWORKS]
    return found


def test_only_the_integrations_import_a_framework():
    """The library and the command alike: the command loads a Hugging Face model through
    gradaccum.integrations.hf_models."""
    found = {
        m: framework_imports(f)
        for m, f in MODULES.items()
        if not m.startswith("gradaccum.integrations")
    }
    assert {m: names for m, names in found.items() if names} == {}


def command_flags() -> set[str]:
    """Every --flag of the command, from its own parser."""
    import argparse

    from gradaccum.app.cli import parser

    flags: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(parser())
    return flags - {"--help"}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants (documentation, never shown by the code)."""
    found = set()
    for node in ast.walk(tree):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr):
            if isinstance(node.body[0].value, ast.Constant):
                found.add(id(node.body[0].value))
    return found


def knows_the_command(file: Path, flags: set[str]) -> list[str]:
    """The command's flags and subcommands named in ``file``'s string literals (docstrings
    aside), and any read of sys.argv."""
    import re

    tree = ast.parse(file.read_text())
    skip, found = docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += [f for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", node.value) if f in flags]
            found += re.findall(r"\bgradaccum (?:train|plan|check|report|audit)\b", node.value)
        if isinstance(node, ast.Attribute) and node.attr == "argv":
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        if isinstance(node, ast.ImportFrom) and node.module == "sys":
            found += [f"from sys import {a.name}" for a in node.names if a.name == "argv"]
    return found


def test_no_library_module_names_a_flag_of_the_command_or_reads_argv():
    flags = command_flags()
    assert {"--effective-batch", "--batch-schedule", "--export"} <= flags
    found = {m: knows_the_command(f, flags) for m, f in LIBRARY.items()}
    assert {m: names for m, names in found.items() if names} == {}


def test_the_checks_see_a_framework_a_flag_and_argv(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""gradaccum train --effective-batch 8 in a docstring is documentation."""\n'
        "import sys\n\n"
        "def f():\n"
        "    from lightning.pytorch import Callback\n"
        "    import transformers.trainer\n"
        "    return sys.argv[0], 'try --effective-batch 28', 'gradaccum plan', "
        "'torchrun --nnodes'\n"
    )
    assert framework_imports(bad) == ["lightning.pytorch", "transformers.trainer"]
    assert sorted(knows_the_command(bad, {"--effective-batch"})) == [
        "--effective-batch",
        "gradaccum plan",
        "sys.argv (line 7)",
    ]
