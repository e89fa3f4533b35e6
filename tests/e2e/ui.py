"""Load MLflow UI pages in headless Chromium: rendered text (after the app's JavaScript) and screenshots."""

from __future__ import annotations

import html
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx


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
