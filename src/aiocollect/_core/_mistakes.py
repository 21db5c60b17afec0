"""The mistakes new users make, each caught with one message that names the user's line and the fix.

- :func:`explicit_keywords`: a misspelt keyword of a public constructor suggests the closest one (as
  argparse does), and TorchRL's spellings (``create_env_fn=``, ``num_workers=``) point to ours and to
  :mod:`aiocollect.compat`, instead of Python's bare "unexpected keyword argument". A family's keywords
  are written once, as a ``TypedDict`` whose values carry their defaults (``Annotated[type,
  Default(value)]``, a required one ``Required[type]``; :func:`keyword_list` reads it): the constructors
  take it as ``**kwargs: Unpack[...]`` (PEP 692: mypy and IDEs show, and check, the keywords), and
  ``explicit_keywords(keywords=...)`` gives them its signature (``help()``), its defaults and its checks.
- :func:`check_main_guard`: a script that starts worker processes from its top level without
  ``if __name__ == "__main__":`` is refused before any process starts (each worker would import the
  script again and start collectors of its own, and die of it).
- :func:`warn_user`: a warning about the user's own arguments, attributed to the user's line rather than
  to a line of aiocollect; :func:`warn_if_spent`: an iteration that will yield nothing (the budget spent).
- :func:`name_coroutines`: a forgotten ``await`` names the user's collector class, not an internal one.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    NotRequired,
    Required,
    TypeVar,
    get_args,
    get_origin,
    get_type_hints,
    overload,
)

__all__ = [
    "Default",
    "KeywordList",
    "check_main_guard",
    "explicit_keywords",
    "keyword_list",
    "name_coroutines",
    "unguarded_main_line",
    "warn_if_spent",
    "warn_rounded",
    "warn_user",
]

#: the package root (this module is in its _core/ folder)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_F = TypeVar("_F", bound=Callable[..., Any])


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside aiocollect, counted from the caller of this
    function's caller (``"<string>"``: a dataclass's generated ``__init__``, ours)."""
    frame = sys._getframe(2)
    level = 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR) or frame.f_code.co_filename == "<string>"
    ):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn about the user's own arguments, at the user's line (the first frame outside aiocollect).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_user("total_frames=1000 is not a multiple of frames_per_batch=300")
        >>> caught[0].filename == __file__ or caught[0].filename.startswith("<doctest")
        True
    """
    warnings.warn(message, category, stacklevel=_user_stacklevel() + 1)


def warn_if_spent(collector: Any) -> Any:
    """Warn (at the user's line) when an iteration begins over ``collector`` that will yield nothing: its
    ``total_frames`` are collected, or a stop was requested. Returns ``collector``."""
    stopped = bool(getattr(collector, "stop_requested", False))
    total, frames = collector.total_frames, collector._stats.frames
    if stopped or 0 < total <= frames:
        why = (
            "a stop was requested (request_stop(), stop_on_signals)"
            if stopped
            else f"it has collected its total_frames={total} already ({frames} frames)"
        )
        warn_user(
            f"this iteration over the {type(collector).__name__} yields nothing: {why}, and a collector is "
            "iterated once. Make a new collector for another run (load_state_dict() goes on from a "
            "checkpoint), or give total_frames=-1 to collect until you stop"
        )
    return collector


def warn_rounded(requested: int, frames: int, of: str) -> None:
    """Warn (at the user's line) that ``frames_per_batch=requested`` became ``frames`` (whole steps of
    ``of``: each member's share rounded up to its envs' batch size)."""
    if frames != requested:
        warn_user(f"frames_per_batch={requested} is not a multiple of {of}: each batch has {frames} frames")


def name_coroutines(cls: type, base: type) -> None:
    """Give ``cls`` its own copy of each public coroutine method it inherits from ``base``, named after
    it: a forgotten ``await`` then warns ``coroutine 'MultiSyncCollector.update_weights' was never
    awaited``, the user's class, where it named ``base``, an internal one."""
    for name, fn in vars(base).items():
        if name.startswith("_") or not inspect.iscoroutinefunction(fn) or getattr(cls, name) is not fn:
            continue  # private, not a coroutine, or overridden on the way
        own = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        functools.update_wrapper(own, fn)
        own.__kwdefaults__ = fn.__kwdefaults__
        vars(own).pop("__wrapped__", None)  # the signature is its own: help() and the docs show the same one
        own.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, own)


# -- keywords ------------------------------------------------------------------------------------------


class Default:
    """A keyword's default, in its annotation: ``Annotated[int | None, Default(-1)]``."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Default({self.value!r})"


@dataclass(frozen=True)
class KeywordList:
    """A keyword list read at run time: its keyword-only parameters (annotation and default, in the list's
    order), the defaults and the required names."""

    params: tuple[inspect.Parameter, ...]
    defaults: Mapping[str, Any]
    required: frozenset[str]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def keyword_list(keywords: type) -> KeywordList:
    """The parameters, defaults and required keywords of ``keywords`` (a ``TypedDict`` whose values are
    ``Annotated[type, Default(value)]`` or ``Required[type]``); ``TypeError`` for a value that is
    neither.

    Example:
        >>> from typing import TypedDict
        >>> class Keywords(TypedDict, total=False):
        ...     frames_per_batch: Required[int]
        ...     total_frames: Annotated[int | None, Default(-1)]
        >>> listed = keyword_list(Keywords)
        >>> listed.defaults, sorted(listed.required)
        ({'total_frames': -1}, ['frames_per_batch'])
        >>> [str(p) for p in listed.params]
        ['frames_per_batch: int', 'total_frames: int | None = -1']
    """
    params, defaults, required = [], {}, set()
    for name, annotation in get_type_hints(keywords, include_extras=True).items():
        if get_origin(annotation) in (Required, NotRequired):  # (read here: a string annotation hides it)
            if get_origin(annotation) is Required:
                required.add(name)
            annotation = get_args(annotation)[0]
        default: Any = inspect.Parameter.empty
        if get_origin(annotation) is Annotated:
            annotation, *extras = get_args(annotation)
            found = [e.value for e in extras if isinstance(e, Default)]
            default = found[0] if found else default
        if (default is inspect.Parameter.empty) == (name not in required):
            raise TypeError(
                f"{keywords.__name__}.{name}: write Annotated[..., Default(value)] or Required[...]"
            )
        if default is not inspect.Parameter.empty:
            defaults[name] = default
        kind = inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(name, kind, default=default, annotation=annotation))
    return KeywordList(tuple(params), defaults, frozenset(required))


#: keywords of TorchRL's collectors that ours spell differently, with the fix
TORCHRL_SPELLINGS: Mapping[str, str] = {
    "create_env_fn": "aiocollect's multi-process collectors take one env factory per worker: "
    "create_env_fns=[make_env] * num_workers (the first argument)",
    "create_env_kwargs": "bind the arguments in each factory instead: "
    "create_env_fns=[functools.partial(make_env, **kwargs)] * num_workers",
    "num_workers": "the number of workers is the length of create_env_fns: "
    "create_env_fns=[make_env] * num_workers",
    "num_threads": "torch's thread count is the trainer's: call torch.set_num_threads() before the collector",
    "policy_factory": "pass the policy itself (it is sent to each worker), or see aiocollect.compat",
    "sync": "use MultiSyncCollector or MultiAsyncCollector (or MultiCollector(sync=...))",
}


#: the collectors aiocollect.compat has under the same name, with TorchRL's keywords
_COMPAT_TWINS = frozenset({"Collector", "MultiSyncCollector", "MultiAsyncCollector", "MultiCollector"})


def _keyword_error(cls_name: str, name: str, accepted: list[str]) -> TypeError:
    message = f"{cls_name}() got an unexpected keyword argument {name!r}"
    close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean {close[0]!r}?"
    if name in TORCHRL_SPELLINGS:
        twin = cls_name if cls_name in _COMPAT_TWINS else "MultiSyncCollector"
        message += (
            f"; {name}= is TorchRL's spelling: {TORCHRL_SPELLINGS[name]}. Or keep TorchRL's keywords with "
            f"aiocollect.compat (from aiocollect.compat import {twin})"
        )
    return TypeError(message)


@overload
def explicit_keywords(init: _F) -> _F: ...
@overload
def explicit_keywords(
    *, refused: Mapping[str, str] | None = None, keywords: type | None = None
) -> Callable[[_F], _F]: ...
def explicit_keywords(
    init: _F | None = None, *, refused: Mapping[str, str] | None = None, keywords: type | None = None
) -> Any:
    """Decorate a public constructor: an unknown keyword raises a ``TypeError`` that names the class the
    user wrote, suggests the closest keyword, and points TorchRL's spellings to ours; a keyword of
    ``refused`` (one the class deliberately does not take) raises its fix. The signature is kept
    (``help()`` and IDEs show the keywords); a known keyword costs one set lookup.

    ``keywords``: the constructor takes its keyword list as ``**kwargs: Unpack[keywords]`` (a
    ``TypedDict`` of ``_keywords.py``'s kind, written once for a family): the constructor's signature
    shows that list (``help()``, ``inspect.signature``), a required keyword that is missing raises as
    Python does, and the constructor receives every keyword of the list, the defaults filled in.

    Example:
        >>> class Collector:
        ...     @explicit_keywords
        ...     def __init__(self, *, total_frames: int = -1) -> None: ...
        >>> Collector(total_frame=10)
        Traceback (most recent call last):
        ...
        TypeError: Collector() got an unexpected keyword argument 'total_frame'; did you mean 'total_frames'?
    """
    if init is None:
        return functools.partial(explicit_keywords, refused=refused, keywords=keywords)
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    taken = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if taken != (keywords is not None):
        raise TypeError(f"{init.__qualname__}: **kwargs goes with explicit_keywords(keywords=...), and only")
    listed = keyword_list(keywords) if keywords is not None else None
    own = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    accepted = [
        p.name
        for p in own
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ][1:] + list(listed.names if listed is not None else ())  # not self
    known = frozenset(accepted)
    fixes = dict(refused or {})
    defaults = dict(listed.defaults) if listed is not None else None
    required = sorted(listed.required) if listed is not None else []

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        for name in kwargs:
            if name not in known:
                if name in fixes:
                    raise TypeError(f"{type(self).__name__} does not take {name}: {fixes[name]}")
                raise _keyword_error(type(self).__name__, name, accepted)
        if defaults is not None:
            for name in required:
                if name not in kwargs:
                    raise TypeError(
                        f"{type(self).__name__}() missing 1 required keyword-only argument: {name!r}"
                    )
            kwargs = {**defaults, **kwargs}
        return init(self, *args, **kwargs)

    if listed is not None:  # help() and inspect.signature show the list, not **kwargs
        wrapper.__signature__ = signature.replace(parameters=[*own, *listed.params])  # type: ignore[attr-defined]
    return wrapper


# -- scripts without a main guard ----------------------------------------------------------------------


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either side)."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str, mtime: float) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of the script's ``if __name__ == "__main__":`` bodies (``None``: unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return tuple(ranges)


def unguarded_main_line() -> tuple[str, int] | None:
    """``(script, line)`` when the calling code runs from the top level of the ``__main__`` script outside
    an ``if __name__ == "__main__":`` block, else ``None`` (guarded, no script file, or not called from
    the script's top level: a notebook, ``python -c``, a worker importing the script)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            break
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    try:
        if not os.path.samefile(frame.f_code.co_filename, path):
            return None
    except OSError:
        return None
    line = frame.f_lineno
    ranges = _guarded_lines(os.path.abspath(path), os.path.getmtime(path))
    if ranges is None or any(first <= line <= last for first, last in ranges):
        return None
    return path, line


def check_main_guard(
    what: str,
    start_method: str | None,
    *,
    other_fix: str | None = 'run the workers as threads with worker_backend="serial"',
) -> None:
    """Refuse to start processes with ``start_method`` (``"spawn"``/``"forkserver"`` re-import the script
    in every child) from the unguarded top level of the user's script, with the fix; ``what`` names the
    caller (``"MultiSyncCollector"``), ``other_fix`` the way out without processes."""
    if start_method not in ("spawn", "forkserver"):
        return
    found = unguarded_main_line()
    if found is None:
        return
    path, line = found
    name = os.path.basename(path)
    message = (
        f"{what} starts worker processes, and each imports your script {name!r} again before it runs; "
        f"line {line} of {name} starts collection when the script is imported, so every worker would "
        "start collectors of its own and die of it. Put the code that starts collection under a main "
        'guard:\n\n    if __name__ == "__main__":\n        anyio.run(main)\n'
    )
    raise RuntimeError(message + (f"\n(or {other_fix})" if other_fix else ""))
