"""A live web dashboard and control panel for a collector: ``create_app(collector)``.

The app is a Starlette ASGI app (``pip install 'aiocollect[dashboard]'``) that runs on the collector's own
event loop: a page with live plots and pause/resume/update-weights buttons, a Server-Sent Events stream of
statistics and events, and JSON endpoints. :func:`serve` runs it with uvicorn inside the current (asyncio)
event loop, beside the collector and a trainer.

Importing this module needs neither starlette nor uvicorn; :func:`create_app` and :func:`serve` import
them when called.
"""

from __future__ import annotations

from ._app import DashboardControls
from ._create import create_app
from ._serve import RunningServer, serve

__all__ = ["DashboardControls", "RunningServer", "create_app", "serve"]
