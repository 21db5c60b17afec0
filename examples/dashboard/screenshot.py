"""Run the dashboard example for a while, drive its page in headless Chromium, and save a screenshot.

    python examples/dashboard/screenshot.py --out docs/img/dashboard.png

Regenerates the picture in ``docs/dashboard.md``. Needs ``pip install playwright`` (the Python package only:
it drives the system's Chromium, ``/usr/bin/chromium`` by default; no browser download).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio
import anyio.abc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import app as dashboard_app  # the example next to this script

# Chromium as root on a machine without network or GPU: these keep it from dialing out or crashing.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


async def main(out: Path, seconds: float, chromium: str, backend: str) -> None:
    from playwright.async_api import async_playwright

    urls: list[str] = []
    ready = anyio.Event()

    def on_ready(url: str) -> None:
        urls.append(url)
        ready.set()

    args = dashboard_app.Args(port=0, backend=backend)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: dashboard_app.main(args, on_ready=on_ready, stop=stop))
        with anyio.fail_after(120):
            await ready.wait()
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = await browser.new_page(viewport={"width": 1440, "height": 1000}, device_scale_factor=1)
            await page.goto(urls[0])
            step = seconds / 6
            for i in range(6):  # a few weight updates and one pause, so every plot has something to show
                await anyio.sleep(step)
                if i == 2:
                    await page.click("#pause")
                    await anyio.sleep(step / 2)
                    await page.click("#resume")
                else:
                    await page.click("#update-weights")
            await anyio.sleep(1.0)
            out.parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(out), full_page=True)
            await browser.close()
        stop.set()  # the example stops after its next batch
    print(f"saved {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    p.add_argument("--seconds", type=float, default=24.0, help="how long to run before the screenshot")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--backend", choices=["process", "serial"], default="process")
    ns = p.parse_args()
    anyio.run(main, ns.out, ns.seconds, ns.chromium, ns.backend)
