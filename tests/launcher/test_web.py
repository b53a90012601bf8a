"""`launcher/web.py`: the live web page of a run.

- `RunReader` reads the trainer's whole metrics lines and samples the real Redis; `/api/state` hands the page
  only what it has not got yet;
- a port in use is one line: `start_in_thread` (what `rlstream run --web` calls) returns None and the
  caller goes on, `rlstream web` exits 1;
- a real `rlstream run --web` of the tiny CPU config, its page loaded in a real headless Chromium driven over
  the Chrome DevTools Protocol: the charts get data of the run (reward per step, queue, trained staleness,
  the live engine's load), no console error or exception, and the screenshot is not blank.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from rlstream.broker import TrajectoryStream, VersionRegistry
from rlstream.launcher.web import RunReader, WebServer, WebUnavailable, build_app, start_in_thread

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _reader(rclient, keys, run_dir) -> RunReader:
    return RunReader(rclient, keys, run_dir, eta=1, batch=2, max_concurrent=4, title="t/0")


def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_state_hands_out_new_rows_and_samples_of_the_real_redis(tmp_path, rclient, keys, group_factory):
    VersionRegistry(rclient, keys).set(3)
    stream = TrajectoryStream(rclient, keys)
    stream.ensure_group()
    stream.append(group_factory())
    full = json.dumps({"step": 1, "reward/mean": 0.5}) + "\n"
    half = json.dumps({"step": 2, "reward/mean": 0.7})
    (tmp_path / "metrics.jsonl").write_text(full + half[:-4])
    reader = _reader(rclient, keys, tmp_path)

    async def two_samples():
        async with aiohttp.ClientSession() as http:
            await reader.sample(http)
            with open(tmp_path / "metrics.jsonl", "a") as f:
                f.write(half[-4:] + "\n")
            await reader.sample(http)

    asyncio.run(two_samples())
    st = reader.state(0, 0)
    assert [r["step"] for r in st["metrics"]] == [1, 2] and st["metrics_next"] == 2
    assert len(st["history"]) == st["history_next"] == 2
    assert st["history"][-1]["served"] == 3 and st["history"][-1]["queued"] == 1
    assert st["latest"]["versions"]["served"] == 3 and st["error"] is None
    later = reader.state(2, 1)  # the page holds two rows and one sample
    assert later["metrics"] == [] and len(later["history"]) == 1



def test_samples_per_s_is_the_console_lines_rate_not_a_plain_window(tmp_path, rclient, keys):
    from rlstream.launcher.live import AcceptedRate

    reader = RunReader(rclient, keys, tmp_path, eta=1, batch=2, max_concurrent=4, title="t/0", n_samples=4)
    console = AcceptedRate(n_samples=4)

    async def samples():
        async with aiohttp.ClientSession() as http:
            for accepted in (0, 2, 2):  # a commit of 2 groups, then none
                rclient.set(keys.admit_accepted, accepted)
                await reader.sample(http)

    asyncio.run(samples())
    hist = reader.state(0, 0)["history"]
    assert [h["accepted"] for h in hist] == [0, 2, 2]
    # the same looks fed to the console line's rate give the same number (the page shows it, not its own)
    for h in hist:
        expect = console.update(h["ts"], {"throughput": {"producer_groups_per_s": 0.0}}, h["accepted"])[0]
    assert hist[-1]["samples_per_s"] == pytest.approx(expect, rel=0.05) and expect > 0
    assert hist[0]["samples_per_s"] == 0.0 and "tokens_per_s" in hist[-1]

def test_a_redis_failure_is_shown_on_the_page_not_raised(tmp_path, redis_factory, keys):
    from rlstream.broker import connect

    server = redis_factory()
    client = connect(server.url, retries=0)
    server.stop()
    reader = _reader(client, keys, tmp_path)

    async def one():
        async with aiohttp.ClientSession() as http:
            await reader.sample(http)

    try:
        asyncio.run(one())
    finally:
        client.close()
    assert reader.error and reader.state(0, 0)["history"] == []


def test_the_server_answers_the_page_and_bad_counts(tmp_path, rclient, keys):
    server = WebServer(build_app(_reader(rclient, keys, tmp_path), 0.2), "127.0.0.1", 0).start()

    async def get(path):
        async with aiohttp.ClientSession() as http, http.get(server.url.rstrip("/") + path) as r:
            return r.status, await r.text()

    try:
        status, page = asyncio.run(get("/"))
        assert status == 200 and "/static/uPlot.iife.min.js" in page
        assert asyncio.run(get("/static/uPlot.iife.min.js"))[0] == 200
        status, body = asyncio.run(get("/api/state?metrics_from=x"))
        assert status == 400 and "metrics_from" in body
    finally:
        server.stop()


def test_a_port_in_use_is_one_line_and_the_run_goes_on(tmp_path, rclient, keys, capsys):
    from rlstream.common.config import load_config

    sock, port = _busy_port()
    try:
        with pytest.raises(WebUnavailable, match=f"cannot listen on 127.0.0.1:{port}"):
            WebServer(build_app(_reader(rclient, keys, tmp_path)), "127.0.0.1", port).start()
        cfg = load_config(str(CONFIG), [f"launcher.web.port={port}"])
        assert start_in_thread(cfg, rclient, keys, tmp_path) is None
    finally:
        sock.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "launcher.web.port" in err[0] and "the run goes on without it" in err[0]


def test_web_cli_on_a_port_in_use_exits_1_with_one_line(redis_url):
    sock, port = _busy_port()
    try:
        proc = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "web", "--config", str(CONFIG),
                               "--redis", redis_url, "--port", str(port)], capture_output=True, text=True, timeout=120)
    finally:
        sock.close()
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"rlstream: error: web page: cannot listen on 127.0.0.1:{port} "
                                                f"(address already in use); set launcher.web.port to a free port"]


# ---------------------------------------------------------------- the page in a real browser
class Chromium:
    """Headless Chromium driven over the DevTools Protocol (one page target; aiohttp's websocket client)."""

    def __init__(self, profile: Path) -> None:
        self.proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                                      "--no-first-run", "--window-size=1400,1100", "--remote-debugging-port=0",
                                      f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.exists() and active.read_text().strip()):
            assert self.proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.2)
        self.port = int(active.read_text().split()[0])
        self.errors: list[str] = []
        self._id = 0

    async def open(self, http: aiohttp.ClientSession) -> None:
        async with http.get(f"http://127.0.0.1:{self.port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            await self.call(method)

    async def call(self, method: str, **params):
        self._id += 1
        await self.ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive()).data)
            self._note(msg)
            if msg.get("id") == self._id:
                assert "error" not in msg, msg
                return msg.get("result", {})

    def _note(self, msg: dict) -> None:
        p = msg.get("params", {})
        if msg.get("method") == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert", "warning"):
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif msg.get("method") == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(p["exceptionDetails"])[:500])
        elif msg.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(p["entry"]["text"])

    async def eval(self, expr: str):
        res = await self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        assert "exceptionDetails" not in res, res
        return res["result"].get("value")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


CHART_LENGTHS = ("Object.fromEntries(Object.entries(window.rlstream.charts).map(([k, c]) => "
                 "[k, {series: c.series.length, axes: c.axes.length, points: c.data.map((a) => a.filter((v) => v !== null"
                 " && v !== undefined).length)}]))")


async def load_page(url: str, profile: Path, ready: str, timeout: float = 120.0) -> tuple[dict, list[str], bytes]:
    """Open `url`, wait until the JS expression `ready` is true; the charts' sizes, console errors, a PNG."""
    browser = Chromium(profile)
    try:
        async with aiohttp.ClientSession() as http:
            await browser.open(http)
            await browser.call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            while not await browser.eval(f"!!(window.rlstream && ({ready}))"):
                assert time.monotonic() < deadline, f"page not ready: {await browser.eval(CHART_LENGTHS)}"
                await asyncio.sleep(0.5)
            charts = await browser.eval(CHART_LENGTHS)
            shot = await browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            return charts, browser.errors, base64.b64decode(shot["data"])
    finally:
        browser.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


READY = ("window.rlstream.charts.reward.data[0].length >= 2 && window.rlstream.charts.staleness.data[1].some((v) => v > 0)"
         " && window.rlstream.charts.engines.data.length >= 2 && window.rlstream.charts.engines.data[1].some((v) => v !== null)")


@pytest.mark.slow
def test_page_of_a_real_run_in_headless_chromium(tmp_path, redis_url, experiment):
    from PIL import Image, ImageStat

    if CHROMIUM is None:
        missing = "the Debian package chromium is not installed (scripts/bootstrap.sh --test installs it)"
        if os.environ.get("RLSTREAM_REQUIRE_CHROMIUM") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    port = _free_port()
    args = [sys.executable, "-m", "rlstream.launcher.cli", "run", "--web", "--config", str(CONFIG), "--redis", redis_url,
            f"cluster.fileroot={tmp_path / 'runs'}", f"experiment_name={experiment}", f"launcher.web.port={port}",
            "total_train_steps=1000", "launcher.demo.n_train=256", "launcher.demo.n_valid=16", "launcher.eval_n=0",
            "launcher.sft_steps=20", "rollout.consumer_batch_size=4", "gconfig.n_samples=4",
            "stats_logger.tensorboard.enabled=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        while f"web page: {url}" not in log.read_text():  # printed once the page listens
            assert proc.poll() is None, f"run ended before serving the page:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        charts, errors, png = asyncio.run(load_page(url, tmp_path / "chromium", READY, timeout=400))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the run stops its children in order
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    assert errors == []
    assert charts["reward"]["points"][1] >= 2  # reward/mean of two trained steps or more
    assert charts["queue"]["points"][0] >= 2 and charts["throughput"]["points"][1] >= 2
    assert charts["staleness"]["points"][1] >= 1  # the head staleness of the groups trained so far
    assert charts["engines"]["series"] == 2 and charts["engines"]["points"][1] >= 1  # x and the one engine's busy fraction
    assert all(c["axes"] >= 2 for c in charts.values())  # every chart has its x and y axes
    img = Image.open(io.BytesIO(png)).convert("L")
    assert img.size[0] >= 1000 and img.size[1] >= 800
    assert ImageStat.Stat(img).stddev[0] > 20  # not blank: text, axes and curves on the page
    out_png = os.environ.get("RLSTREAM_WEB_SCREENSHOT")
    if out_png:  # how docs/img/web.png is made
        Path(out_png).write_bytes(png)
