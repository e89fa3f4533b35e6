"""Headless Chromium for the UI tests: MLflow UI pages' rendered text (after the app's JavaScript) and screenshots,
and a page driven over the DevTools protocol (:func:`browser_page`: evaluate, click, the requests it made)."""

from __future__ import annotations

import html
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
from websockets.sync.client import connect


@contextmanager
def mlflow_ui(store_uri: str) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 (a free port) over ``store_uri``; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen([str(mlflow_bin), "server", "--backend-store-uri", store_uri, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise AssertionError("mlflow server did not start")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def page_text(chromium: str, url: str, screenshot: Path | None = None) -> str:
    """Visible text of ``url`` once its JavaScript has rendered; optionally a PNG screenshot."""
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    if screenshot is not None:
        subprocess.run([*base, f"--screenshot={screenshot}", "--window-size=1400,1100", url], capture_output=True,
                       timeout=180)
    text = re.sub(r"<(style|script)[^>]*>.*?</\1>", " ", dom, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return re.sub(r"\s+", " ", text)  # after unescaping: &nbsp; becomes a plain space too


class Page:
    """One Chromium tab over the DevTools protocol: navigate, evaluate JavaScript, click like a mouse, and list the
    URLs the page requested."""

    def __init__(self, ws: Any):
        self.ws, self.ids, self.events = ws, itertools.count(1), []

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are kept in ``events``)."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time())))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def goto(self, url: str, timeout: float = 60) -> None:
        """Open ``url`` and wait for its load event."""
        self.call("Page.enable")
        self.call("Network.enable")
        self.call("Page.navigate", url=url)
        deadline = time.time() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time()))))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values)."""
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in out:
            raise AssertionError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def click(self, selector: str) -> None:
        """A left mouse click at the centre of the first element ``selector`` matches (scrolled into view)."""
        box = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
                            "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def requested(self) -> list[str]:
        """Every URL the page asked for since it was opened."""
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]


@contextmanager
def browser_page(chromium: str) -> Iterator[Page]:
    """A headless Chromium (its own profile, a free debugging port) and one of its tabs as a :class:`Page`."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "chromium.log"  # a file, not a pipe: nobody must keep reading it
        with log.open("w") as err:
            proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                                     "--remote-debugging-port=0", f"--user-data-dir={tmp}/profile", "about:blank"],
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            port = _devtools_port(proc, log)
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            with connect(url, max_size=None, open_timeout=30) as ws:
                yield Page(ws)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def _devtools_port(proc: subprocess.Popen, log: Path, timeout: float = 60) -> int:
    """The port Chromium prints (``DevTools listening on ws://127.0.0.1:PORT/...``) to its log."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        time.sleep(0.2)
    raise AssertionError("chromium did not open its debugging port:\n" + log.read_text(errors="replace")[-2000:])
