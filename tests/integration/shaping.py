"""Whether this machine can build bench/shaped_network.py's emulated internet (the benchmarks on shaped links)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def can_shape() -> bool:
    """Root, a TUN device, iproute2 and tc, and a kernel that lets us make a network namespace."""
    if os.geteuid() != 0 or not Path("/dev/net/tun").exists() or not (shutil.which("ip") and shutil.which("tc")):
        return False
    made = subprocess.run(["ip", "netns", "add", "nls-probe"], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", "nls-probe"], capture_output=True)
    return made


def leftover_namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in listed if line.startswith(f"{prefix}-")]


SHAPING_NEEDS = "needs root, /dev/net/tun, iproute2 (ip, tc) and network namespaces"
