"""The house rules, checked on the source: who may import whom, and how long a function
may grow. Read from the code itself (``ast``), so a new module is held to them at once."""

import ast
import os

import pytest
from conftest import REPO

# The library's packages, lowest floor first: a package imports only from its own
# floor or below (models/ and configs/ stand apart: they import no trainer module).
FLOORS = (
    ("errors", "console", "faults", "jax_internals"),
    ("workdir",),
    ("parallel", "input", "reporting"),
    ("checkpoint", "tasks", "hf"),
    ("training",),
    ("analysis", "inference"),
)


def _modules(top: str):
    for root, _, files in os.walk(os.path.join(REPO, top)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, REPO), _parse(path)


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def _is_command(path: str, tree: ast.Module) -> bool:
    """A command: a module run as ``python -m`` (it has an ``if __name__ ==
    "__main__"`` block), or in the packages of commands (``trainer/command/``, the
    process around them, and ``trainer/data/``, the data commands)."""
    if path.split(os.sep)[:2] in (["trainer", "command"], ["trainer", "data"]):
        return True
    return any(
        isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body
    )


def _package(path: str) -> str:
    parts = path.removesuffix(".py").split(os.sep)
    return parts[1] if len(parts) > 2 else parts[1]


def test_only_commands_import_the_command_package():
    offenders = [
        path
        for path, tree in _modules("trainer")
        if not _is_command(path, tree)
        and any(m == "trainer.command" or m.startswith("trainer.command.") for m in _imports(tree))
    ]
    assert offenders == []


def test_library_packages_import_only_their_floor_or_below():
    floor_of = {name: i for i, names in enumerate(FLOORS) for name in names}
    upward = []
    for path, tree in _modules("trainer"):
        if _is_command(path, tree) or path == os.path.join("trainer", "__init__.py"):
            continue
        here = _package(path)
        assert here in floor_of, f"{path}: package {here!r} has no floor in FLOORS"
        for module in _imports(tree):
            parts = module.split(".")
            if parts[0] != "trainer" or len(parts) < 2 or parts[1] not in floor_of:
                continue
            if floor_of[parts[1]] > floor_of[here]:
                upward.append(f"{path} imports {module}")
    assert upward == []


@pytest.mark.parametrize("top", ["models", "configs"])
def test_models_and_configs_stand_apart_from_the_trainer_library(top):
    # Configs may read a Hugging Face config.json through trainer.hf.config (no JAX; the
    # package imports nothing): nothing the trainer library builds on imports a config.
    allowed = {"trainer", "trainer.hf", "trainer.hf.config", "trainer.errors"}
    found = [
        f"{path} imports {m}"
        for path, tree in _modules(top)
        for m in _imports(tree)
        if m.startswith("trainer") and m not in allowed
    ]
    assert found == []


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_no_function_of_the_trainer_is_longer_than_120_lines():
    long = [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in _modules("trainer")
        for node in _functions(tree)
        if node.end_lineno - node.lineno + 1 > 120
    ]
    assert long == []


def test_the_training_function_reads_in_at_most_100_lines():
    path = os.path.join(REPO, "trainer", "training", "train.py")
    tree = _parse(path)
    (node,) = [n for n in _functions(tree) if n.name == "_train"]
    assert node.end_lineno - node.lineno + 1 <= 100


def test_jax_internals_are_read_in_one_place():
    # trainer/jax_internals.py is the one table of what JAX does not promise: private
    # modules and the parameter keys of jaxprs. Nothing else reads them.
    offenders = []
    for top in ("trainer", "models", "configs", "launch", "scripts"):
        for path, tree in _modules(top):
            if path == os.path.join("trainer", "jax_internals.py"):
                continue
            for node in ast.walk(tree):
                private = isinstance(node, ast.Constant) and "jax._src" in str(node.value)
                private |= any(m.startswith("jax._src") for m in _imports(node))
                params = (
                    isinstance(node, ast.Attribute)
                    and node.attr == "params"
                    and "eqn" in ast.unparse(node.value)
                )
                if private or params:
                    offenders.append(f"{path}:{node.lineno}")
    assert offenders == []
