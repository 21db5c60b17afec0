"""The dashboard against other pages and bad requests: no page may frame it (every response says so), and a
malformed, oversized or non-ASCII request is answered 400/431 on its own connection while the dashboard
goes on serving (uvicorn's h11 protocol, whose request heads are bounded)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from aiocollect import Collector
from aiocollect.dashboard import create_app, serve
from attacks import exchange, status
from support import cartpole2 as cartpole

pytestmark = pytest.mark.anyio

FRAMING = {"x-frame-options": "DENY", "content-security-policy": "frame-ancestors 'none'"}


def framing_of(response: httpx.Response) -> dict[str, str | None]:
    return {name: response.headers.get(name) for name in FRAMING}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_every_response_forbids_framing_and_bad_requests_close_their_connection_only() -> None:
    async with Collector(cartpole, frames_per_batch=16) as collector:
        app = create_app(collector)
        async with httpx.AsyncClient(timeout=10) as client:
            with anyio.fail_after(30):
                async with serve(app, port=0) as server:
                    url = server.url
                    responses = [
                        await client.get(url),
                        await client.get(url + "statistics"),
                        await client.get(url + "history.json"),
                        await client.get(url + "no-such-page"),
                        await client.post(url + "pause"),  # 403: no token
                        await client.get(url + "statistics", headers={"Host": "evil.example"}),  # 400
                    ]
                    assert [r.status_code for r in responses] == [200, 200, 200, 404, 403, 400]
                    for response in responses:
                        assert framing_of(response) == FRAMING, response.url
                    for bad in (
                        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: \xff\xfe\x80\r\n\r\n",
                        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (20 * 1024) + b"\r\n\r\n",
                        b"\x00\x01\x02 garbage\r\n\r\n",
                        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(2000)) + b"\r\n",
                    ):
                        answer, _ = await exchange(server.port, bad)
                        assert status(answer) in (200, 400, 431), answer[:200]
                    # a 4 MB head: read up to the bound only (its answer may be lost to the reset)
                    await exchange(server.port, b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 2**22 + b"\r\n\r\n")
                    assert (await client.get(url + "statistics")).status_code == 200
