"""A PNG of the Ray dashboard's Actors page, taken in a real browser (headless Chromium), logged in.

    python infra/dashboard_screenshot.py http://127.0.0.1:8265 runs/demo/report/dashboard_actors.png

Ray's token authentication is on by default: the dashboard's API answers 401 without the token, and its
web UI keeps the token in the `ray-authentication-token` cookie. This script starts Chromium headless with
its DevTools port on loopback, sets that cookie from ~/.ray/auth_token (RAY_AUTH_TOKEN_PATH), opens the
Actors page, waits for it to render and saves a screenshot. Needs Debian's `chromium` package
(`bash infra/ensure_chromium.sh`). Not here: anything the demo computes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

COOKIE = "ray-authentication-token"  # ray._private.authentication.authentication_constants


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token() -> str | None:
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.exists() else None


async def _shoot(devtools: int, url: str, out: Path, settle_s: float) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        for _ in range(100):  # Chromium opens its DevTools endpoint a moment after start
            try:
                async with http.get(f"http://127.0.0.1:{devtools}/json/list") as r:
                    pages = [p for p in await r.json() if p["type"] == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError("headless Chromium did not open its DevTools endpoint")
        async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 10**6))

            async def call(method: str, **params) -> dict:
                i = next(ids)
                await ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
                while True:
                    msg = json.loads((await ws.receive()).data)
                    if msg.get("id") == i:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg.get("result", {})

            await call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
            token = _token()
            if token:
                await call("Network.setCookie", name=COOKIE, value=token, url=f"{urlparse(url).scheme}://"
                           f"{urlparse(url).netloc}/", path="/")  # fmt: skip
            await call("Page.navigate", url=url)
            await asyncio.sleep(settle_s)  # the dashboard's client renders after its API calls return
            shot = await call("Page.captureScreenshot", format="png")
            out.write_bytes(base64.b64decode(shot["data"]))


def screenshot(dashboard_url: str, out: Path, settle_s: float = 8.0) -> Path:
    """Save the Actors page of the dashboard at `dashboard_url` to `out`; raises if Chromium is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise FileNotFoundError("no chromium on PATH: run `bash infra/ensure_chromium.sh` (Debian's package)")
    port = _free_port()
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1",
                                 f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            asyncio.run(_shoot(port, dashboard_url.rstrip("/") + "/#/actors", out, settle_s))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return out


if __name__ == "__main__":
    t0 = time.monotonic()
    path = screenshot(sys.argv[1], Path(sys.argv[2]))
    print(f"{path} ({path.stat().st_size} bytes, {time.monotonic() - t0:.1f} s)")
