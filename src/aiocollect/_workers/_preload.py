"""What a worker process imports before it is forked, and tensordict imported without ``torch._dynamo``.

Importing tensordict registers a few of its functions with ``torch.compiler.allow_in_graph``, and each such
call imports ``torch._dynamo``: some 800 modules (sympy, ``torch._inductor``, ``torch.distributed.tensor``)
that a collector never uses unless something is compiled. They doubled the time an interpreter takes to
import torch and tensordict (1.7 s → 3.5 s, here) and added ~70 MB to it: to the forkserver, which every
worker is forked from, and so to the first start-up of every multi-process collector.

:func:`lean_tensordict_import` imports tensordict with those registrations held back until
``torch._dynamo`` is imported for a reason of its own (``torch.compile``, ``compile_policy``, a compiled
policy unpickled): an import hook registers them as soon as ``torch._dynamo`` has loaded, before anything
can be compiled, so what dynamo knows when it compiles is what it would have known otherwise.
``assume_constant_result`` only marks the function, which is done at once. ``aiocollect`` calls it first
thing (importing this module calls it), in every process: the forkserver, and the trainer when it has not
imported tensordict yet.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["PRELOAD", "lean_tensordict_import"]

#: modules the forkserver imports once, in this order, so that each worker forked from it starts in a
#: fraction of a second: ``aiocollect`` imports tensordict through :func:`lean_tensordict_import`; the
#: last one freezes the heap imported so far out of the garbage collector (see ``_freeze.py``)
PRELOAD = ["aiocollect._workers._worker", "gymnasium", "aiocollect._workers._freeze"]

_lock = threading.Lock()
#: functions given to ``allow_in_graph`` while tensordict was imported, not registered with dynamo yet
_pending: list[Callable[..., Any]] = []
_deferring = False


def _allow_in_graph(fn: Any) -> Any:
    """``torch.compiler.allow_in_graph`` while tensordict is imported: ``fn`` is registered once
    ``torch._dynamo`` is imported (the real one afterwards, for calls made later through this name)."""
    if not _deferring:
        assert _real_allow_in_graph is not None  # set before this function is handed out
        return _real_allow_in_graph(fn)
    if isinstance(fn, (list, tuple)):
        return [_allow_in_graph(x) for x in fn]
    if not callable(fn):
        raise AssertionError("allow_in_graph expects a callable")
    with _lock:
        _pending.append(fn)
    return fn


def _assume_constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (it marks ``fn``)."""
    fn._dynamo_marked_constant = True
    return fn


_real_allow_in_graph: Callable[[Any], Any] | None = None


def _register_pending() -> None:
    """Give dynamo the functions held back (it has been imported)."""
    import torch._dynamo

    with _lock:
        pending = list(_pending)
        _pending.clear()
    for fn in pending:
        torch._dynamo.allow_in_graph(fn)


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """A one-shot ``sys.meta_path`` finder: when ``torch._dynamo`` is imported, its module runs as usual,
    then the held-back functions are registered (before the import returns to whoever asked for it)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:  # pragma: no cover - every loader of a .py package has it
            return spec

        def exec_then_register(module: Any) -> None:
            del loader.exec_module  # the loader's own method again (a reload runs it alone)
            exec_module(module)
            _register_pending()

        loader.exec_module = exec_then_register
        return spec


def lean_tensordict_import() -> None:
    """Import tensordict (and ``tensordict.nn``) without ``torch._dynamo``, unless either is imported
    already (then there is nothing to save, or nothing to hold back)."""
    global _deferring, _real_allow_in_graph
    if "tensordict" in sys.modules or "torch._dynamo" in sys.modules:
        return
    import torch.compiler

    real_allow, real_assume = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
    _real_allow_in_graph = real_allow
    hook = _AfterDynamo()
    sys.meta_path.insert(0, hook)
    _deferring = True
    torch.compiler.allow_in_graph = _allow_in_graph
    torch.compiler.assume_constant_result = _assume_constant_result
    try:
        import tensordict
        import tensordict.nn  # noqa: F401
    finally:
        torch.compiler.allow_in_graph = real_allow
        torch.compiler.assume_constant_result = real_assume
        _deferring = False
        if "torch._dynamo" in sys.modules:  # imported meanwhile (by a plugin?): register now
            with _lock:
                if hook in sys.meta_path:
                    sys.meta_path.remove(hook)
            _register_pending()


lean_tensordict_import()
