"""`rlstream trace view RUN_DIR`: a run's merged trace in speedscope, offline; `--png` draws one track to a picture.

speedscope (https://github.com/jlfwong/speedscope, MIT, vendored in `launcher/static/speedscope/`, see
`launcher/static/VENDORED.md`) is a static page that reads Chrome trace-event JSON; it shows one track (process,
thread) at a time as a flame chart in time order. The page and the trace are served from 127.0.0.1 (the page
fetches the trace by its `#profileURL=` hash). `--png` opens that page in headless Chromium over the DevTools
Protocol (https://chromedevtools.github.io/devtools-protocol/), picks the chosen track in speedscope's track list
and saves a screenshot. Perfetto (ui.perfetto.dev, Open trace file) opens the same file with
every track at once; Chromium 156 no longer has chrome://tracing.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from rlstream.launcher.trace_merge import MERGED_NAME, merge_traces

__all__ = ["merged_trace", "TraceServer", "screenshot", "chromium_path", "SPEEDSCOPE_DIR"]

SPEEDSCOPE_DIR = Path(__file__).parent / "static" / "speedscope"
TRACE_ROUTE = "/trace.json"
# speedscope sets the document title to "<file name> - speedscope" once a profile is loaded and drawn
LOADED = "document.title.endsWith(' - speedscope')"
# the toolbar's middle text names the track shown: "<process> (pid N), <thread> (tid M)"
TRACK_TITLE = "(document.body.innerText.split('\\n').find((l) => l.includes('(pid ')) || '')"
# speedscope's track list (its toolbar's drop-down) keeps one row per track in the page, titled with the track's
# name, that selects it on mouseup: pick the first whose name holds TRACK; its name, or null
PICK_TRACK = ("(() => { const row = Array.from(document.querySelectorAll('tr[title]')).find((r) => r.title.includes(TRACK));"
              " if (row) row.dispatchEvent(new MouseEvent('mouseup', {bubbles: true})); return row ? row.title : null; })()")


def merged_trace(run_dir: str | Path) -> Path:
    """The run's merged trace: `RUN_DIR/trace/merged.trace.json`, merged now when missing; or RUN_DIR itself when it
    is a trace file."""
    path = Path(run_dir)
    if path.is_file():
        return path
    folder = path / "trace" if (path / "trace").is_dir() else path
    merged = folder / MERGED_NAME
    return merged if merged.is_file() else merge_traces(run_dir)


class _Handler(http.server.SimpleHTTPRequestHandler):
    trace_file: Path

    def translate_path(self, path: str) -> str:
        if path.split("?", 1)[0] == TRACE_ROUTE:
            return str(self.trace_file)
        return super().translate_path(path)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per file fetched says nothing to a user


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A browser that closes a connection mid-file (headless Chromium does) is not an error of the view.
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class TraceServer:
    """The vendored speedscope page and one trace file on 127.0.0.1:`port` (0: a free port), in a daemon thread."""

    def __init__(self, trace_file: Path, port: int = 0) -> None:
        handler = type("TraceHandler", (_Handler,), {"trace_file": Path(trace_file).resolve()})
        self.httpd = _Server(
            ("127.0.0.1", port), functools.partial(handler, directory=str(SPEEDSCOPE_DIR)))
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="trace-view", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        base = f"http://127.0.0.1:{self.port}"
        return f"{base}/index.html#profileURL={base}{TRACE_ROUTE}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class _Browser:
    """Headless Chromium with one page, driven over the DevTools Protocol (aiohttp's websocket client)."""

    def __init__(self, binary: str, profile: Path, width: int, height: int) -> None:
        self.proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      f"--window-size={width},{height}", "--remote-debugging-port=0",
                                      f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.exists() and active.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{binary} did not start its DevTools port within 60 s")
            time.sleep(0.2)
        self.port = int(active.read_text().split()[0])
        self._id = 0

    async def open(self, http: aiohttp.ClientSession) -> None:
        async with http.get(f"http://127.0.0.1:{self.port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.call("Page.enable")

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        await self.ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method}: {msg['error']}")
                return msg.get("result", {})

    async def eval(self, expr: str) -> Any:
        res = await self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        return res["result"].get("value")

    async def wait_for(self, expr: str, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not await self.eval(expr):
            if time.monotonic() > deadline:
                raise RuntimeError(f"speedscope did not {what} within {timeout:.0f} s")
            await asyncio.sleep(0.25)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


async def _shoot(browser: _Browser, url: str, track: str, timeout: float) -> tuple[str, bytes]:
    async with aiohttp.ClientSession() as http:
        await browser.open(http)
        await browser.call("Page.navigate", url=url)
        await browser.wait_for(LOADED, timeout, "load the trace")
        picked = await browser.eval(PICK_TRACK.replace("TRACK", json.dumps(track)))
        if picked is None:
            raise ValueError(f"no track of the trace has {track!r} in its name")
        await browser.wait_for(f"{TRACK_TITLE}.startsWith({json.dumps(picked)})", 10, f"show the track {picked}")
        title = await browser.eval(TRACK_TITLE)
        # the flame chart's canvas is drawn on an animation frame after the switch: wait for two to pass
        await browser.call("Runtime.evaluate", awaitPromise=True, expression="new Promise((r) => "
                           "requestAnimationFrame(() => requestAnimationFrame(() => r(true))))")
        shot = await browser.call("Page.captureScreenshot", format="png")
        return title, base64.b64decode(shot["data"])


def screenshot(trace_file: Path, out: str | Path, track: str = "trainer", width: int = 1600, height: int = 480,
               timeout: float = 60.0) -> str:
    """Draw `trace_file` in speedscope in headless Chromium, on the first track whose title holds `track`, into the
    PNG `out`; returns that track's title. Raises RuntimeError (no Chromium, no page) or ValueError (no such track)."""
    binary = chromium_path()
    if binary is None:
        raise RuntimeError("trace view --png needs Chromium on PATH (chromium, chromium-browser or google-chrome; "
                           "Debian: apt-get install chromium)")
    server = TraceServer(trace_file)
    try:
        with tempfile.TemporaryDirectory(prefix="rlstream-chromium-") as profile:
            browser = _Browser(binary, Path(profile), width, height)
            try:
                title, png = asyncio.run(_shoot(browser, server.url, track, timeout))
            finally:
                browser.close()
    finally:
        server.close()
    Path(out).write_bytes(png)
    return title
