"""Build docker/Dockerfile.cpu with podman and run processes from the built image, on a machine without a container
engine that can start containers (this one): a local Debian base from debootstrap, `podman build --isolation
chroot`, and the image's filesystem mounted read-only (`podman image mount`) and entered with chroot, with the
image's environment and user, a host directory bound on its /data volume, and the host's network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BASE_IMAGE = "localhost/noloco-base:bookworm"
ROOT = Path(__file__).resolve().parents[2]


def missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "building and entering images needs root"
    absent = [tool for tool in ("podman", "debootstrap", "chroot", "mount") if shutil.which(tool) is None]
    return f"missing {', '.join(absent)} (apt-get install podman debootstrap)" if absent else None


def _run(command: list[str], log: Path, timeout: float) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{command[0]} {command[1]} failed ({done.returncode}); see {log}:\n{log.read_text()[-3000:]}"
        )


def ensure_base(log: Path) -> None:
    """A minimal Debian bookworm with python3 and venv, imported as a podman image (made once per machine)."""
    if subprocess.run(["podman", "image", "exists", BASE_IMAGE], check=False).returncode == 0:
        return
    with tempfile.TemporaryDirectory(prefix="noloco-rootfs-") as rootfs:
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                rootfs,
                "http://deb.debian.org/debian",
            ],
            log,
            timeout=900,
        )
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        with log.open("a") as out:
            imported = subprocess.run(
                ["podman", "import", "-", BASE_IMAGE],
                stdin=tar.stdout,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            )
        tar.wait()
        if imported.returncode != 0:
            raise RuntimeError(f"podman import failed; see {log}")


def build_cpu_image(tag: str, log: Path) -> dict:
    """Build the CPU image from the unchanged Dockerfile on the local base; returns `podman image inspect` of it.

    The torch wheel comes from this machine's wheel folder (/opt/wheels, when it has one) instead of PyTorch's CPU
    index, which is out of reach here; everything else from PyPI, through the host's CA bundle."""
    command = [
        "podman",
        "build",
        "--format",
        "docker",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "-v",
        "/etc/ssl/certs:/etc/ssl/certs:ro",
        "--build-arg",
        f"BASE={BASE_IMAGE}",
    ]
    if Path("/opt/wheels").is_dir():
        command += [
            "-v",
            "/opt/wheels:/opt/wheels:ro",
            "--build-arg",
            "PIP_FIND_LINKS=/opt/wheels",
            "--build-arg",
            "TORCH_INDEX_URL=https://pypi.org/simple",
        ]
    command += ["-f", str(ROOT / "docker/Dockerfile.cpu"), "-t", tag, str(ROOT)]
    _run(command, log, timeout=1800)
    inspected = subprocess.run(["podman", "image", "inspect", tag], capture_output=True, text=True, check=True)
    return json.loads(inspected.stdout)[0]


class ImageRoot:
    """The image's filesystem, mounted read-only, with /data bound to ``data_dir``, /tmp to ``scratch``, and the
    host's /proc, /dev and /sys."""

    def __init__(self, tag: str, config: dict, data_dir: Path, scratch: Path) -> None:
        self.tag = tag
        self.config = config
        self.data_dir = data_dir
        self.root = Path(
            subprocess.run(["podman", "image", "mount", tag], capture_output=True, text=True, check=True).stdout.strip()
        )
        self._bound: list[Path] = []
        try:
            # A container's /tmp is writable (torch's shared-memory manager makes its socket directory there).
            scratch.mkdir(exist_ok=True)
            scratch.chmod(0o1777)
            for source, target in (
                (data_dir, "data"),
                (scratch, "tmp"),
                (Path("/proc"), "proc"),
                (Path("/dev"), "dev"),
                (Path("/sys"), "sys"),
            ):
                subprocess.run(["mount", "--rbind", str(source), str(self.root / target)], check=True)
                self._bound.append(self.root / target)
                # Private, so that unmounting this copy later can never propagate to the host's own mounts.
                subprocess.run(["mount", "--make-rprivate", str(self.root / target)], check=True)
        except BaseException:
            self.close()
            raise

    def environment(self) -> dict[str, str]:
        env = dict(item.split("=", 1) for item in self.config.get("Env", []))
        env["HOME"] = "/home/noloco"
        return env

    def popen(self, args: list[str], log: Path) -> subprocess.Popen:
        """``noloco-node ARGS`` as the image's entrypoint and user would run it."""
        user = self.config.get("User", "root")
        uid = {"noloco": "10001:10001"}.get(user, user)
        out = log.open("w")
        return subprocess.Popen(
            ["chroot", f"--userspec={uid}", str(self.root), *self.config["Entrypoint"], *args],
            env=self.environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def close(self) -> None:
        for target in reversed(self._bound):
            subprocess.run(["umount", "--recursive", "--lazy", str(target)], check=False)
        self._bound = []
        subprocess.run(["podman", "image", "unmount", self.tag], check=False, capture_output=True)
