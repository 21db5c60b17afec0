"""The package's shape, checked: module and function sizes, ``__all__`` everywhere, no private name imported
across modules, and imports that run down the layers drawn in ``docs/architecture.md``.

These are the targets of the "one house" redesign; a change that breaks one either fixes the code or
changes the picture (here and in the docs) on purpose.
"""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "aiocollect"

MAX_MODULE_LINES = 600
MEDIAN_MODULE_LINES = 250
MAX_FUNCTION_LINES = 80

# Layers, bottom (0) to top. A module may import from its own layer and the layers below it.
LAYERS: dict[str, int] = {
    # base utilities: no aiocollect imports above this layer
    "_errors": 0,
    "_options": 0,
    "_validation": 0,
    "_rng": 0,
    "_pids": 0,
    "_daemon": 0,
    "_torch_settings": 0,
    "_events": 0,
    "_stats": 0,
    "_progress": 0,
    "_gather": 0,
    "_gcfreeze": 0,
    # envs (no policies: an env never imports a policy)
    "_envs": 1,
    # policies, random policies for an env, weights as TensorDicts
    "_policies": 2,
    "_fast_policy": 2,
    "_fast_verify": 2,
    "_weights": 2,
    # the wire and the rollout core
    "_transport": 3,
    "_rollout": 3,
    "_recurrent": 3,
    "_rollout_thread": 3,
    "_storage": 3,
    "_trajectories": 3,
    # worker processes and weight-sync schemes
    "_workers": 4,
    "_weightsync": 4,
    "_distributed_weights": 4,
    # envs stepped in worker processes (ProcessVectorEnv): the workers' layer
    "_procenv": 4,
    # local collectors
    "_base": 5,
    "_collector": 5,
    "_multi": 5,
    "_fleet": 5,
    "_sinks": 5,
    "_async": 5,
    # remote collectors: their nodes and actors host local collectors
    "_remote": 6,
    # envs and policies served over WebSocket (issue 16): servers host envs and policies
    "_serve": 6,
    # the public surface
    "compat": 7,
    "dashboard": 7,
    "__init__": 7,
}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def layer_of(parts: tuple[str, ...]) -> int:
    """The layer of a module given its dotted parts below ``aiocollect``."""
    if not parts:
        return LAYERS["__init__"]
    head = parts[0]
    for name, level in LAYERS.items():
        if head == name or head.startswith(name + "_"):  # _multi_sync, _multi_async ...
            return level
    raise AssertionError(f"aiocollect.{'.'.join(parts)} is in no layer: add it to LAYERS in {__file__}")


def module_parts(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported(path: Path, node: ast.ImportFrom) -> tuple[str, ...] | None:
    """The aiocollect module an ``import from`` names, as parts below ``aiocollect`` (None: not ours)."""
    if node.level == 0:
        mod = (node.module or "").split(".")
        return tuple(mod[1:]) if mod[0] == "aiocollect" else None
    here = list(module_parts(path))
    if path.name != "__init__.py":
        here = here[:-1]  # a module's package
    base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
    return tuple(base) + (tuple(node.module.split(".")) if node.module else ())


def is_module(parts: tuple[str, ...]) -> bool:
    target = PACKAGE.joinpath(*parts)
    return target.with_suffix(".py").exists() or (target / "__init__.py").exists()


TREES = {path: ast.parse(path.read_text(), filename=str(path)) for path in modules()}


def test_module_sizes() -> None:
    sizes = {rel(p): p.read_text().count("\n") for p in TREES}
    too_long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
    assert statistics.median(sizes.values()) <= MEDIAN_MODULE_LINES


def test_function_sizes() -> None:
    too_long = [
        f"{rel(p)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for p, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def declares_all(tree: ast.Module) -> bool:
    for stmt in tree.body:
        targets = (
            stmt.targets
            if isinstance(stmt, ast.Assign)
            else [stmt.target]
            if isinstance(stmt, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


@pytest.mark.parametrize("path", list(TREES), ids=rel)
def test_every_module_declares_all(path: Path) -> None:
    assert declares_all(TREES[path]), f"{rel(path)} has no __all__"


def test_no_private_name_crosses_modules() -> None:
    crossings = []
    for path, tree in TREES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or (target := imported(path, node)) is None:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and not is_module(target + (alias.name,)):
                    crossings.append(f"{rel(path)}: {alias.name} from aiocollect.{'.'.join(target)}")
    assert not crossings, "private names imported across modules: " + "; ".join(crossings)


def test_imports_run_down_the_layers() -> None:
    upward = []
    for path, tree in TREES.items():
        here = layer_of(module_parts(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or (target := imported(path, node)) is None:
                continue
            targets = [target + (a.name,) if is_module(target + (a.name,)) else target for a in node.names]
            for t in targets:
                if layer_of(t) > here:
                    upward.append(
                        f"{rel(path)} (layer {here}) imports aiocollect.{'.'.join(t)} (layer {layer_of(t)})"
                    )
    assert not upward, "imports against the layers: " + "; ".join(sorted(set(upward)))
