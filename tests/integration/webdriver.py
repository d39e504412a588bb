"""A minimal W3C WebDriver client for Debian's chromedriver + headless chromium: just what the page test needs.

WebDriver is plain JSON over HTTP, so this needs no selenium: start chromedriver on a free port, open a session
with headless chromium, load a page, run a script, take a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--window-size=1400,1000",
]


def browser_missing() -> str | None:
    """Why a browser test cannot run here, or None when chromium and chromedriver are installed."""
    for binary in ("chromium", "chromedriver"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (Debian: apt-get install chromium chromium-driver)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Browser:
    def __init__(self, log_path: Path) -> None:
        self.port = _free_port()
        self._log = log_path.open("w")
        self.driver = subprocess.Popen(
            ["chromedriver", f"--port={self.port}"], stdout=self._log, stderr=subprocess.STDOUT
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if self._call("GET", "/status")["value"]["ready"]:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromedriver did not come up within 30 s")
            time.sleep(0.2)
        options = {"binary": shutil.which("chromium"), "args": CHROMIUM_ARGS}
        created = self._call(
            "POST",
            "/session",
            {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}},
            timeout=60,
        )
        self.session = created["value"]["sessionId"]

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 30) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def open(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url}, timeout=60)

    def run(self, script: str) -> Any:
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": []})["value"]

    def screenshot(self, path: Path) -> None:
        encoded = self._call("GET", f"/session/{self.session}/screenshot")["value"]
        path.write_bytes(base64.b64decode(encoded))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._call("DELETE", f"/session/{self.session}")
        self.driver.terminate()
        try:
            self.driver.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.driver.kill()
        self._log.close()
