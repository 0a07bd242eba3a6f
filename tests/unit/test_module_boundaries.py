"""The package's layers, held by a test instead of a line cap (read from the source with ``ast``).

Layers, bottom up (see docs/architecture.md): ``errors``, ``_fs``, ``_version``, ``compile``,
``hostmem`` (leaves) < ``format`` < ``store`` < ``remote`` < ``save`` | ``offload`` (side by side,
neither imports the other) < ``functional`` < ``lightning`` < ``cli``, ``bench``, ``__init__``.

* a module imports modules of its own layer or of lower layers only (every import counts: at the
  top, inside a function, under ``TYPE_CHECKING``);
* no import circle between modules;
* Lightning is imported only under ``lightning/`` (and by the user-facing ``cli`` and ``bench``);
* no module uses another module's ``_private`` names: ``from lightning_ckpt.x import _y``,
  ``x._y`` on an imported module of ours, or ``obj._y`` where ``_y`` is a private attribute or
  method that only other modules of ours define (a reach-in past a class's public methods);
* the installed package never imports the repository's ``benchmarks/``.

A module is split when it has two jobs, not when it has many lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_ckpt"

# Layer of each top-level name under lightning_ckpt; a module may import its own layer and lower ones.
LAYERS: dict[str, int] = {
    "errors": 0, "_fs": 0, "_version": 0, "compile": 0, "hostmem": 0,
    "format": 1,
    "store": 2,
    "remote": 3,
    "save": 4, "offload": 4,
    "functional": 5,
    "lightning": 6, "export": 6,
    "": 7,  # the package's __init__: the public surface
    "bench": 8,
    "cli": 9,
    "__main__": 10,
}
SIDE_BY_SIDE = {frozenset({"save", "offload"}), frozenset({"lightning", "export"})}  # same layer, never importing each other
LIGHTNING_ALLOWED = {"lightning", "cli", "bench"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _top(module: str) -> str:
    """The layer a module belongs to: its first name under ``lightning_ckpt`` ("" for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every import of the source, wherever it stands."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, _resolve(node, module, is_package), [a.name for a in node.names]))
    return found


def _targets(source: str, names: list[str]) -> list[str]:
    """Our modules an import statement makes this module depend on: ``from pkg import mod`` names
    the module ``pkg.mod``; ``from mod import name`` the module ``mod``."""
    if not source.startswith("lightning_ckpt"):
        return []
    submodules = [f"{source}.{n}" for n in names if f"{source}.{n}" in MODULES]
    others = [n for n in names if f"{source}.{n}" not in MODULES]
    return submodules + ([source] if others or not names else [])


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for _, source, names in _imports(tree, module, path.name == "__init__.py"):
            graph[module].update(t for t in _targets(source, names) if t != module)
    return graph


def _layer_violations(module: str, target: str) -> str | None:
    mine, theirs = _top(module), _top(target)
    if mine == theirs:
        return None
    if frozenset({mine, theirs}) in SIDE_BY_SIDE:
        return f"{module} imports {target}: `{mine}/` and `{theirs}/` stand side by side"
    if LAYERS[theirs] >= LAYERS[mine]:
        return f"{module} imports {target}: an import up (or across) the layers ({mine or '__init__'} -> {theirs or '__init__'})"
    return None


def test_layers_import_downward_only() -> None:
    found = [v for module, targets in _graph().items() for t in sorted(targets) if (v := _layer_violations(module, t))]
    assert found == [], "\n".join(found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_lightning_is_imported_only_under_lightning() -> None:
    found = []
    for module, path in MODULES.items():
        if _top(module) in LIGHTNING_ALLOWED:
            continue
        for line, source, _ in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            if source == "lightning" or source.startswith(("lightning.", "pytorch_lightning")):
                found.append(f"{module}:{line} imports {source}")
    assert found == [], "Move what needs Lightning under lightning_ckpt/lightning/:\n" + "\n".join(found)


def test_the_package_never_imports_the_repositorys_benchmarks() -> None:
    found = [
        f"{module}:{line}"
        for module, path in MODULES.items()
        for line, source, _ in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py")
        if source == "benchmarks" or source.startswith("benchmarks.")
    ]
    found += [str(path) for path in MODULES.values() if '"benchmarks' in path.read_text() or "'benchmarks" in path.read_text()]
    assert found == []


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# torch's private attributes that our code reads on torch's objects (a module's ``_buffers``, a
# state dict's ``_metadata``): not ours, even where one of our classes uses the same name.
TORCH_PRIVATE = {n for n in (*dir(torch.nn.Module()), *dir(torch.Tensor)) if _private(n)} | {"_metadata"}


def _defined_private_attributes(tree: ast.AST) -> set[str]:
    """Private methods and attributes a module's classes define (``def _x``, ``self._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    names.add(item.name)
                elif isinstance(item, (ast.AnnAssign, ast.Assign)):
                    for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        if isinstance(target, ast.Name) and _private(target.id):
                            names.add(target.id)
                        if isinstance(target, ast.Attribute) and _private(target.attr):
                            names.add(target.attr)
    return names


def _violations_in(source_text: str, module: str, is_package: bool, owned_elsewhere: set[str] = frozenset()) -> list[str]:
    tree = ast.parse(source_text)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> module of ours it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_ckpt"):
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, module, is_package)
            if not source.startswith("lightning_ckpt") or source == module:
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in MODULES or (PACKAGE.parent / Path(*target.split("."))).with_suffix(".py").exists():
                    aliases[alias.asname or alias.name] = target  # a module, private or not
                elif _private(alias.name):
                    found.append(f"{module}:{node.lineno} imports {alias.name} from {source}")
    mine = _defined_private_attributes(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in aliases:
            if aliases[node.value.id] != module:
                found.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr} ({aliases[node.value.id]})")
        elif (
            node.attr in owned_elsewhere
            and node.attr not in mine | TORCH_PRIVATE
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{module}:{node.lineno} reaches into another module's {node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    trees = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}
    defined = {module: _defined_private_attributes(tree) for module, tree in trees.items()}
    found = []
    for module, path in MODULES.items():
        if _top(module) == "bench":
            continue  # the user-facing harness measures the plugin's internals on purpose
        elsewhere = set().union(*(names for other, names in defined.items() if other != module))
        found += _violations_in(path.read_text(), module, path.name == "__init__.py", elsewhere)
    assert found == [], "Give what is shared a public name in the module that owns it:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------- the checkers


def test_the_private_checker_sees_every_kind_of_private_use() -> None:
    # The check itself must fail on what it is meant to catch; a private module is fine.
    probe = (
        "from lightning_ckpt.format.reader import _Dir\n"
        "from lightning_ckpt import remote, _fs\n"
        "from .store import commit as w\n"
        "remote._zstd()\n"
        "w._remove('x')\n"
        "_fs.anything\n"
        "def f(saver):\n"
        "    saver._drain()\n"
    )
    found = _violations_in(probe, "lightning_ckpt.probe", is_package=False, owned_elsewhere={"_drain"})
    assert len(found) == 4, found
    assert "_Dir" in found[0] and "remote._zstd" in found[1] and "w._remove" in found[2] and "_drain" in found[3]


def test_the_layer_and_circle_checkers_fail_on_what_they_forbid() -> None:
    assert _layer_violations("lightning_ckpt.format.plan", "lightning_ckpt.save.job") is not None
    assert _layer_violations("lightning_ckpt.offload.adamw", "lightning_ckpt.save.staging") is not None
    assert _layer_violations("lightning_ckpt.save.job", "lightning_ckpt.lightning.plugin") is not None
    assert _layer_violations("lightning_ckpt.save.job", "lightning_ckpt.format.plan") is None
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", sorted(name for name in LAYERS if name))
def test_every_layer_folder_says_what_it_is_for(layer: str) -> None:
    folder = PACKAGE / layer
    if folder.is_dir():
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert docstring, f"lightning_ckpt/{layer}/__init__.py needs a docstring: the layer's one-line responsibility"


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their basename (no packages under tests/): two of the same name
    in different tiers stop the whole run at collection ("import file mismatch")."""
    names = defaultdict(list)
    for path in (PACKAGE.parent / "tests").rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(PACKAGE.parent)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}
