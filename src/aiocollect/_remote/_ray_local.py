"""A local Ray cluster that stays on loopback.

``ray.init(_node_ip_address="127.0.0.1")`` is not enough: Ray rewrites a loopback node address to the
machine's network address (``resolve_ip_for_localhost``), and its GCS, raylet and workers then listen on
every interface and talk over the external one. Ray keeps a cluster on loopback only where it does not
support clusters (macOS, Windows: its ``ENABLE_RAY_CLUSTER`` switch). :func:`init_local` turns that
switch off for the duration of ``ray.init`` when the config asks for a local cluster on a loopback
address, so that every process of the cluster binds to ``127.0.0.1``; a config naming another node
address (a real cluster's private interface) or an ``address`` to join is passed to ``ray.init`` as it
is. Once started, the node's address is checked: a Ray that rewrote it anyway gets a warning.

Example:
    >>> import ray  # doctest: +SKIP
    >>> init_local(ray, {"address": "local", "_node_ip_address": "127.0.0.1"})  # doctest: +SKIP
    >>> ray.util.get_node_ip_address()  # doctest: +SKIP
    '127.0.0.1'
"""

from __future__ import annotations

import importlib
import ipaddress
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["init_local", "is_loopback"]


def is_loopback(host: Any) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host)).is_loopback
    except ValueError:
        return False


def init_local(ray: Any, config: Mapping[str, Any]) -> None:
    """``ray.init(**config)``; a local cluster on a loopback ``_node_ip_address`` is kept on loopback."""
    node = config.get("_node_ip_address")
    local = config.get("address", "local") == "local" and is_loopback(node)
    switch = _cluster_switch() if local else None
    if switch is None:
        ray.init(**config)
    else:
        before = switch.ENABLE_RAY_CLUSTER
        switch.ENABLE_RAY_CLUSTER = False  # Ray's own "loopback only" mode (see the module docs)
        try:
            ray.init(**config)
        finally:
            switch.ENABLE_RAY_CLUSTER = before
    if local and not is_loopback(got := ray.util.get_node_ip_address()):
        warnings.warn(
            f"Ray moved the local cluster from {node} to {got}: its processes may listen on every "
            "interface; firewall them, or see https://docs.ray.io/en/latest/ray-security/index.html",
            UserWarning,
            stacklevel=2,
        )


def _cluster_switch() -> Any:
    """Ray's constants module when it has the ``ENABLE_RAY_CLUSTER`` switch (``None``: another Ray)."""
    try:
        constants = importlib.import_module("ray._private.ray_constants")
    except ImportError:
        return None
    return constants if isinstance(getattr(constants, "ENABLE_RAY_CLUSTER", None), bool) else None
