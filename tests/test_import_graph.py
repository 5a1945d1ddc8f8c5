"""The OpenAI edge (`thermostat/api/`) and the gateway never reach torch, the engine, the model
code, the KV transfer or the engine's server (`server/`): read from the import graph itself
(every `import` in every module, at any depth, so a lazy import inside a function counts too),
except under `if TYPE_CHECKING:` and in a package's module-level `__getattr__` (PEP 562: it runs
only when that lazily exported name is asked for, as `thermostat.LLM` is). Two rules read more:
an edge module names no `server/` module even for typing, and neither the edge nor `server/`
reaches a command module (`commands/`: what the commands share is a library they call)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "thermostat"
# server/ drives the engine: the edge and the gateway build on api/, never on it.
FORBIDDEN = (
    "torch",
    "thermostat.engine",
    "thermostat.models",
    "thermostat.disagg",
    "thermostat.server",
)
TORCH_FREE = ("thermostat.api", "thermostat.gateway")


def module_path(name: str) -> Path | None:
    """The file of a thermostat module (a package's __init__.py), None for any other module."""
    if name != "thermostat" and not name.startswith("thermostat."):
        return None
    base = PACKAGE.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _not_run_on_import(node: ast.AST) -> bool:
    """An `if TYPE_CHECKING:` block, or a module-level `__getattr__` (see the docstring)."""
    if isinstance(node, ast.FunctionDef):
        return node.name == "__getattr__"
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def imports_of(name: str, typing: bool = False) -> frozenset[str]:
    """The modules `name` imports (each `from a.b import c` as a.b and, if a module, a.b.c);
    a submodule also imports its parent packages, as Python runs them first. `typing`: those of
    `if TYPE_CHECKING:` blocks too."""
    path = module_path(name)
    if path is None:
        return frozenset()
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node in tree.body and _not_run_on_import(node):
            skip.update(id(n) for n in ast.walk(node))
        elif isinstance(node, ast.If) and _not_run_on_import(node) and not typing:
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if module_path(f"{base}.{a.name}"))
    parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return frozenset(found | parents)


def reached(start: str) -> dict[str, str]:
    """Every module `start` reaches, with the module that first imported it."""
    seen: dict[str, str] = {start: ""}
    todo = [start]
    while todo:
        current = todo.pop()
        for name in imports_of(current):
            if name not in seen:
                seen[name] = current
                todo.append(name)
    return seen


def chain(seen: dict[str, str], name: str) -> str:
    links = [name]
    while seen[links[-1]]:
        links.append(seen[links[-1]])
    return " <- ".join(links)


def modules_under(package: str) -> list[str]:
    root = PACKAGE.parent.joinpath(*package.split("."))
    return sorted(
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in root.rglob("*.py")
    )


TORCH_FREE_MODULES = [m for package in TORCH_FREE for m in modules_under(package)]


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_the_edge_and_the_gateway_never_reach_torch_or_the_engine(module):
    seen = reached(module)
    bad = sorted(name for name in seen if forbidden(name))
    assert not bad, "\n".join(chain(seen, name) for name in bad)


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_the_edge_names_no_server_module_even_for_typing(module):
    bad = sorted(n for n in imports_of(module, typing=True) if n.startswith("thermostat.server"))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(
    "module", modules_under("thermostat.api") + modules_under("thermostat.server")
)
def test_the_edge_and_the_server_reach_no_command_module(module):
    seen = reached(module)
    bad = sorted(n for n in seen if n.startswith("thermostat.commands"))
    assert not bad, "\n".join(chain(seen, name) for name in bad)


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking_blocks():
    assert "torch" in imports_of("thermostat.models.llama")  # a sanity check of the reader
    assert "thermostat.server.app" in imports_of("thermostat.server.command")  # in a function
    assert "thermostat.engine.loader" in imports_of("thermostat.llm")  # imported in __init__
    assert "thermostat.llm" not in imports_of("thermostat")  # PEP 562 __getattr__ only
    assert len(TORCH_FREE_MODULES) > 20
    assert "thermostat.engine.llm_engine" in imports_of("thermostat.server.engine_io", typing=True)
    assert "thermostat.engine.llm_engine" not in imports_of("thermostat.server.engine_io")


def test_no_import_cycle_between_server_state_and_systemd():
    assert "thermostat.systemd" not in reached("thermostat.server.state")
    assert "thermostat.server.state" not in reached("thermostat.systemd")
