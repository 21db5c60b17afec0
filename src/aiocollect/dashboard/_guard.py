"""The dashboard's guard against other web pages in the user's browser (an ASGI middleware).

* **DNS rebinding**: a page of ``evil.example`` whose name is made to resolve to ``127.0.0.1`` reaches the
  dashboard as *same-origin* for the browser; only the ``Host`` header tells it apart. Every request
  whose host is not on the allow-list (``127.0.0.1``, ``localhost``, ``::1``, the host ``serve`` binds,
  and ``allowed_hosts``) is refused with 400.
* **Cross-site requests**: a state-changing request (any method but ``GET``/``HEAD``/``OPTIONS``) needs
  the app's token in the ``X-Aiocollect-Token`` header (the page the app serves carries it, and its
  script sends it; another page cannot read it) and, when the browser says where it comes from, an
  ``Origin`` that is the dashboard's own; otherwise 403. A browser cannot add that header to a
  cross-origin request without a CORS preflight, which the app never grants.
* **Framing** (clickjacking): every response says ``X-Frame-Options: DENY`` and
  ``Content-Security-Policy: frame-ancestors 'none'``, so that no other page can show the dashboard in a
  frame and trick a click on its buttons.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._app import to_json

__all__ = ["DEFAULT_HOSTS", "FRAMING_HEADERS", "TOKEN_HEADER", "Guard", "HostPolicy", "hostname"]

TOKEN_HEADER = "x-aiocollect-token"
#: hosts every dashboard answers to (``serve`` adds the host it binds)
DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})
#: added to every response: no page may frame the dashboard
FRAMING_HEADERS = ((b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'"))


def hostname(host_header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``), lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        return host.rsplit(":", 1)[0]
    return host


class HostPolicy:
    """The hosts a dashboard answers to, and its token."""

    def __init__(self, allowed_hosts: Iterable[str] | None, token: str | None) -> None:
        hosts = DEFAULT_HOSTS if allowed_hosts is None else (*DEFAULT_HOSTS, *allowed_hosts)
        self.hosts = {hostname(h) if h != "*" else "*" for h in hosts}
        self.token = token if token is not None else secrets.token_urlsafe(32)

    def allow(self, host: str) -> None:
        """Answer to ``host`` too (``serve`` adds the host it binds; a wildcard address adds nothing)."""
        if host not in _WILDCARDS:
            self.hosts.add(hostname(host))

    def host_allowed(self, host_header: str) -> bool:
        return "*" in self.hosts or hostname(host_header) in self.hosts


class Guard:
    """ASGI middleware enforcing a :class:`HostPolicy` (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan (the app has no websockets)
            await self.app(scope, receive, send)
            return
        send = _unframable(send)
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if not self.policy.host_allowed(host):
            await _refuse(
                send,
                400,
                f"host {host!r} is not allowed: open the dashboard as http://127.0.0.1:<port>/, or give "
                "create_app(..., allowed_hosts=[...]) the names it is reached by",
            )
            return
        if scope["method"] not in _SAFE_METHODS:
            problem = self._state_change_problem(scope, headers, host)
            if problem is not None:
                await _refuse(send, 403, problem)
                return
        await self.app(scope, receive, send)

    def _state_change_problem(self, scope: Scope, headers: Headers, host: str) -> str | None:
        origin = headers.get("origin")
        own = f"{scope.get('scheme', 'http')}://{host}".lower()
        if origin is not None and origin.lower() != own:
            return f"cross-origin request refused (Origin {origin!r} is not {own!r})"
        if headers.get("sec-fetch-site") == "cross-site":
            return "cross-site request refused"
        token = headers.get(TOKEN_HEADER)
        if token is None:
            return f"missing {TOKEN_HEADER} header (the dashboard's page sends it; see app.state.token)"
        if not secrets.compare_digest(token.encode(), self.policy.token.encode()):
            return f"wrong {TOKEN_HEADER} header"
        return None


def _unframable(send: Send) -> Send:
    """``send`` adding :data:`FRAMING_HEADERS` to the response's start (a CSP the app set stays, with
    ``frame-ancestors 'none'`` appended)."""

    async def send_unframable(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            names = {bytes(name).lower() for name, _ in headers}
            for name, value in FRAMING_HEADERS:
                if name not in names:
                    headers.append((name, value))
                elif name == b"content-security-policy":
                    headers = [
                        (n, bytes(v) + b"; " + value if bytes(n).lower() == name else v) for n, v in headers
                    ]
            message = {**message, "headers": headers}
        await send(message)

    return send_unframable


async def _refuse(send: Send, status: int, message: str) -> None:
    body = to_json({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
