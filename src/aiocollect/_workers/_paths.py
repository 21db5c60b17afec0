"""Attribute paths into a worker's env and policy (``get_distant_attr`` / ``map_fn``).

A path is ``env`` or ``policy`` followed by attribute names and integer or string subscripts, e.g.
``"env.transform[0].max_steps"`` or ``"policy.module['actor'].weight"``. It is parsed (never evaluated), so
a path can reach attributes and items and nothing else.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["parse_path", "resolve"]

_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(-?\d+)\]|\[('[^'\]]*'|\"[^\"\]]*\")\]")
_ROOT = re.compile(r"(env|policy)\b")


def parse_path(path: Any, argument: str = "path") -> tuple[str, list[str | int]]:
    """``(root, steps)``: a step is an attribute name (str) or a subscript (int, or a quoted str kept with its
    quotes). Raises ``ValueError`` naming ``argument`` for anything else."""
    if not isinstance(path, str):
        raise TypeError(f"{argument} must be a str such as 'env.max_steps', got {path!r}")
    root = _ROOT.match(path)
    if root is None:
        raise ValueError(f"{argument}={path!r} must start with 'env' or 'policy' (e.g. 'env.transform[0]')")
    steps: list[str | int] = []
    pos = root.end()
    while pos < len(path):
        m = _STEP.match(path, pos)
        if m is None:
            raise ValueError(
                f"{argument}={path!r}: cannot read {path[pos:]!r}; use attribute names and [int] or ['key'] "
                "subscripts"
            )
        name, index, key = m.groups()
        steps.append(name if name is not None else int(index) if index is not None else key)
        pos = m.end()
    return root.group(1), steps


def resolve(roots: dict[str, Any], path: str) -> Any:
    """The object at ``path`` below ``roots[root]``."""
    root, steps = parse_path(path)
    obj = roots[root]
    for step in steps:
        if isinstance(step, int):
            obj = obj[step]
        elif step[0] in "'\"":
            obj = obj[step[1:-1]]
        else:
            obj = getattr(obj, step)
    return obj
