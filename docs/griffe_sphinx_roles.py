"""A griffe extension for the API pages: turns the docstrings' Sphinx habits into what mkdocstrings shows.

* Sphinx roles (``:class:`GymEnv```, ``:meth:`update_weights```): a class, function or exception that
  ``aiocollect`` exports (and ``docs/api.md`` documents) becomes a link to its entry; anything else
  becomes inline code.
* ``Example:`` (napoleon's spelling) becomes ``Examples:``, so that ``>>>`` lines render as code.
* ``a, b: description`` in an ``Args:`` or ``Attributes:`` section (napoleon's shared entry) becomes
  one entry per name.
* ``Args:`` entries for arguments that reach ``__init__`` through ``**kwargs`` (documented on a subclass,
  defined by a base class) move to a ``Keyword Args:`` section, typed from the base class's signature.
* A constructor that takes a keyword list as ``**kwargs: Unpack[SomeKeywords]`` (a ``TypedDict`` whose
  values carry their defaults, ``Annotated[type, Default(value)]``; see ``src/aiocollect/_core/_mistakes.py``)
  shows its keywords instead, one keyword-only parameter each, typed and with its default, as ``help()``
  does.

Used by ``mkdocs.yml``; the source docstrings stay plain Google style with Sphinx roles.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|exc|mod|data|obj):`~?\.?([^`]+)`")
_ARGS = re.compile(r"(Args|Arguments|Parameters|Params):")
_ATTRS = re.compile(r"Attributes:")
_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)
_DOCS = Path(__file__).resolve().parent
_INIT = _DOCS.parent / "src" / "aiocollect" / "__init__.py"


def _exported() -> set[str]:
    """The names of ``aiocollect.__all__`` that the API page documents (so that a link resolves), read
    without importing the package (and torch). tests/test_examples.py checks that none is missing."""
    documented = set(re.findall(r"^::: aiocollect\.(\w+)$", (_DOCS / "api.md").read_text(), re.M))
    for node in ast.parse(_INIT.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            assert isinstance(node.value, ast.List | ast.Tuple)
            return {ast.literal_eval(e) for e in node.value.elts} & documented
    return set()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


class SphinxRoles(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self.exported = _exported()

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, set())

    @staticmethod
    def _keyword_list(func: griffe.Function) -> None:
        """``**kwargs: Unpack[SomeKeywords]`` -> the keywords of ``SomeKeywords`` (its bases' first)."""
        var = [p for p in func.parameters if p.kind is griffe.ParameterKind.var_keyword]
        ann = var[0].annotation if var else None
        if not (isinstance(ann, griffe.ExprSubscript) and str(ann.left) == "Unpack"):
            return
        keywords = func.modules_collection[ann.slice.canonical_path]  # type: ignore[union-attr]
        listed: dict[str, griffe.Parameter] = {}
        for klass in [*reversed(keywords.mro()), keywords]:
            for member in klass.members.values():
                value = getattr(member, "annotation", None)
                if not member.is_attribute or not isinstance(value, griffe.ExprSubscript):
                    continue
                default = None
                if str(value.left) == "Annotated":
                    value, default = value.slice.elements[0], value.slice.elements[1].arguments[0]
                elif str(value.left) == "Required":
                    value = value.slice
                kind = griffe.ParameterKind.keyword_only
                param = griffe.Parameter(member.name, annotation=value, kind=kind, default=default)
                listed[member.name] = param
        kept = [p for p in func.parameters if p is not var[0]]
        func.parameters = griffe.Parameters(*kept, *listed.values())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if isinstance(obj, griffe.Function):
            self._keyword_list(obj)
        if obj.docstring is not None:
            value = _ROLE.sub(self._role, obj.docstring.value)
            value = _EXAMPLE.sub(r"\1Examples:", value)
            value = self._split(obj, value, _ARGS, forward=True)
            obj.docstring.value = self._split(obj, value, _ATTRS, forward=False)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]

    def _role(self, match: re.Match[str]) -> str:
        role, target = match.groups()
        name = target.split(".")[-1]
        if role in ("class", "func", "exc", "obj") and name in self.exported:
            return f"[`{name}`][aiocollect.{name}]"
        return f"`{name}`"

    @staticmethod
    def _signature(obj: griffe.Object) -> tuple[set[str], dict[str, str]] | None:
        """The parameter names of ``obj``, and the typed parameters its ``**kwargs`` may reach."""
        params = getattr(obj, "parameters", None)
        if params is None:
            return None
        names = {p.name for p in params}
        forwarded: dict[str, str] = {}
        if any(p.kind is griffe.ParameterKind.var_keyword for p in params) and isinstance(obj, griffe.Class):
            for base in obj.mro():
                init = base.members.get("__init__")
                for p in getattr(init, "parameters", ()):
                    if p.annotation is not None:
                        forwarded.setdefault(p.name, str(p.annotation))
        return names, forwarded

    def _split(self, obj: griffe.Object, text: str, header: re.Pattern[str], *, forward: bool) -> str:
        """Split shared entries of the first ``header`` section; with ``forward``, move ``**kwargs``
        entries to a ``Keyword Args:`` section."""
        lines = text.split("\n")
        starts = [i for i, line in enumerate(lines) if header.fullmatch(line.strip())]
        if not starts:
            return text
        signature = self._signature(obj) if forward else None
        start = starts[0]
        section_indent = _indent(lines[start])
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > section_indent):
            end += 1
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1
        body = lines[start + 1 : end]
        if not body:
            return text
        item_indent = _indent(body[0])
        items: list[list[str]] = []
        for line in body:
            if line.strip() and _indent(line) == item_indent:
                items.append([line])
            elif items:
                items[-1].append(line)
        kept: list[str] = []
        moved: list[str] = []
        for item in items:
            head, _, rest = item[0].strip().partition(":")
            names = [n.strip() for n in head.split(",")]
            if not rest or not all(n.isidentifier() for n in names):
                kept.extend(item)
                continue
            for name in names:
                entry = [" " * item_indent + f"{name}:{rest}", *item[1:]]
                if signature is not None and name not in signature[0] and name in signature[1]:
                    entry[0] = " " * item_indent + f"{name} ({signature[1][name]}):{rest}"
                    moved.extend(entry)
                else:
                    kept.extend(entry)
        section = [lines[start], *kept]
        if moved:
            section += ["", " " * section_indent + "Keyword Args:", *moved]
        return "\n".join(lines[:start] + section + lines[end:])
