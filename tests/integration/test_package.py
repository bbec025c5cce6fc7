"""The two layers: the library (`import gradaccum`: torch and the standard library, nothing
else) and the command on top of it (gradaccum.app), which the library never imports.

Frameworks (transformers, lightning, peft, accelerate, deepspeed, tensorboard) are extras
imported only by the modules that need them. What an import loads is checked in a fresh
interpreter, where nothing else has imported them first; what a module could import later
(inside a function) is read off its source."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import gradaccum as ga

PACKAGE = Path(ga.__file__).parent
# The command's door: `python -m gradaccum` runs the app, and nothing imports __main__.
DOOR = PACKAGE / "__main__.py"


def imported_modules(path: Path) -> set[str]:
    """Every module a file's import statements name, at top level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def library_files() -> list[Path]:
    app = PACKAGE / "app"
    return [p for p in PACKAGE.rglob("*.py") if app not in p.parents and p != DOOR]


def test_no_library_module_imports_the_app():
    assert len(library_files()) > 20  # the walk found the library
    leaks = {
        str(path.relative_to(PACKAGE)): sorted(
            m
            for m in imported_modules(path)
            if m == "gradaccum.app" or m.startswith("gradaccum.app.")
        )
        for path in library_files()
    }
    assert {k: v for k, v in leaks.items() if v} == {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The library modules a file imports when it runs (type-checking imports left out),
    with the packages each import runs first: importing a.b.c runs a/b/__init__.py."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    with_parents = {".".join(n.split(".")[:i]) for n in names for i in range(2, n.count(".") + 2)}
    # A module's own packages are already running when it imports a sibling: not an edge.
    own = module_name(path)
    return {m for m in with_parents & known if not own.startswith(m + ".")}


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_two_library_modules_import_each_other():
    """engine -> diagnose -> check -> engine was one (the engine's BatchNorm warning): the
    BatchNorm helpers live below the engine now."""
    files = {module_name(p): p for p in library_files()}
    known = set(files)
    graph = {name: runtime_imports(path, known) - {name} for name, path in files.items()}
    assert "gradaccum.engine" in graph["gradaccum.diagnose.check"]
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert import_cycle(graph) == ["a", "b", "c", "a"]
    assert import_cycle({"d": {"d.e"}, "d.e": set()}) is None


def test_the_check_sees_an_import_of_the_app_inside_a_function(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f():\n    from gradaccum.app import launch\n")
    assert "gradaccum.app.launch" in imported_modules(sneaky)


# torch and what it imports on its own: measured first, so anything new is gradaccum's doing.
TORCH = (
    "import torch, torch.distributed, torch.nn.parallel, torch.utils.checkpoint; "
    "import torch.distributed.fsdp"
)


def test_the_library_imports_only_torch_and_the_standard_library():
    code = (
        f"import json, sys; {TORCH}; before = set(sys.modules); import gradaccum; "
        # every public name, so every module they come from loads (they load on first use)
        "[getattr(gradaccum, name) for name in gradaccum.__all__]; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out)
    ours = {m for m in loaded if m == "gradaccum" or m.startswith("gradaccum.")}
    assert "gradaccum.engine" in ours  # the check sees what the import brought in
    assert not any(m.startswith("gradaccum.app.recipes") for m in ours), sorted(ours)
    assert not {"gradaccum.app", "gradaccum.app.cli", "gradaccum.app.measure"} & ours, sorted(ours)
    roots = {m.split(".")[0] for m in loaded} - {"gradaccum", "torch"}
    third_party = {r for r in roots if r not in sys.stdlib_module_names and not r.startswith("_")}
    assert not third_party, sorted(third_party)


def test_all_lists_the_public_api_only():
    assert "inject_oom" not in ga.__all__ and "format_bytes" not in ga.__all__
    assert all(not name.startswith("_") for name in ga.__all__)
    assert {"Accumulator", "Precision", "OOMReplay", "NoiseScale", "plan", "check"} <= set(
        ga.__all__
    )
    for name in ga.__all__:
        assert getattr(ga, name).__module__.startswith("gradaccum."), name
    json.dumps(ga.__all__)


def test_importing_the_library_loads_nothing_until_a_name_is_used():
    """``import gradaccum`` is cheap (the command installs its Ctrl-C handler before torch
    loads); the first use of a name loads its module (PEP 562: the package is a plain
    module, no class swapped in), and the planning package and ``ga.plan()`` have names of
    their own: importing the package, or a module of it, binds the package and leaves
    ``gradaccum.plan`` the function (0.7's subpackage ``gradaccum.plan`` shared the
    function's name: ``import gradaccum.plan as p`` bound the function)."""
    code = (
        "import json, sys, types; import gradaccum; a = 'torch' in sys.modules; "
        "plain = type(gradaccum) is types.ModuleType; "
        "import gradaccum.planning as p; m = isinstance(p, types.ModuleType); "
        "import gradaccum.planning.pipeline, gradaccum.planning.prober; "
        "from gradaccum.planning import Plan; from gradaccum.planning.core import plan; "
        "q = gradaccum.plan is plan is p.plan and callable(gradaccum.plan); "
        "print(json.dumps([a, plain, m, q, Plan.__module__, gradaccum.Accumulator.__module__]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == [
        False, True, True, True, "gradaccum.planning.result", "gradaccum.engine"
    ]  # fmt: skip


def test_no_public_name_is_also_a_module_of_the_package():
    """A name ``ga.X`` that is also a module ``gradaccum.X`` becomes the module once that
    module is imported (the import binds it on the package): none is both."""
    import pkgutil

    modules = {m.name for m in pkgutil.iter_modules(ga.__path__)}
    assert "planning" in modules and "plan" not in modules
    assert not set(ga.__all__) & modules, sorted(set(ga.__all__) & modules)
