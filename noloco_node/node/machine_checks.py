"""This machine's checks, before a node joins (node/doctor.py runs them with the network's; `join` prints them at
its start as one block, :func:`log_local_checks`): the torch build against the device (a GPU with a CPU build of
torch, or ``--device cuda`` that torch cannot use), host memory and device memory for the chosen model (the bytes
per parameter a node holds, node/memory.py), disk for its checkpoints, the announced address (a loopback address
cannot be dialed from another machine), the gRPC port free. Each check that fails says how to fix it.
"""

from __future__ import annotations

import logging
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.reachability import announce_host
from noloco_node.node.memory import DEVICE_BYTES, GIB, available_memory, host_bytes_per_parameter

log = logging.getLogger(__name__)

Level = Literal["ok", "warn", "fail"]
CHECKPOINT_BYTES = 2 * 16  # a checkpoint (phi, delta, theta, Adam's moments: about 16 B/param) and its next copy
_LOOPBACK = ("127.", "localhost", "::1")


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[self.level]
        return f"{mark} {self.name}: {self.detail}" + (f"\n       fix: {self.fix}" if self.fix else "")


def gpu_present() -> bool:
    """An NVIDIA GPU on this machine, whatever torch makes of it (its driver, or its tool on PATH)."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def torch_build(device: str) -> Check:
    cuda_build = torch.version.cuda is not None
    build = f"torch {torch.__version__} ({'CUDA ' + str(torch.version.cuda) if cuda_build else 'CPU'} build)"
    if gpu_present() and not cuda_build:
        return Check(
            "torch",
            "fail",
            f"this machine has an NVIDIA GPU but {build} cannot use it: the model would train on the CPU",
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/), or pass --device cpu",
        )
    if device == "cuda" and not torch.cuda.is_available():
        return Check(
            "torch",
            "fail",
            f"--device cuda, but {build} sees no usable GPU",
            "check the driver (nvidia-smi) and the CUDA build of torch, or pass --device auto",
        )
    return Check("torch", "ok", f"{build}, {'a GPU' if torch.cuda.is_available() else 'no GPU'} in use")


def host_memory(parameters: int, on_gpu: bool) -> Check:
    per = host_bytes_per_parameter(on_gpu)
    needed, available = parameters * per, available_memory()
    detail = f"{parameters / 1e6:.1f}M parameters x {per} B/param = {needed / GIB:.2f} GiB of host memory"
    if available is None:
        return Check("host memory", "warn", detail + "; available memory unknown here")
    if needed > available:
        return Check(
            "host memory",
            "fail",
            f"{detail}, {available / GIB:.2f} GiB available",
            "pick a smaller --model (noloco-node sizes), or free memory; docs/data-and-models.md says what fits",
        )
    return Check("host memory", "ok", f"{detail}, {available / GIB:.1f} GiB available")


def device_memory(parameters: int) -> Check:
    needed = parameters * DEVICE_BYTES
    _free, total = torch.cuda.mem_get_info()
    detail = f"{parameters / 1e6:.1f}M parameters x {DEVICE_BYTES} B/param = {needed / GIB:.2f} GiB on the GPU"
    if needed > total:
        return Check("device memory", "fail", f"{detail}, the GPU has {total / GIB:.1f} GiB", "pick a smaller --model")
    return Check("device memory", "ok", f"{detail} of {total / GIB:.1f} GiB")


def disk(data_dir: Path, parameters: int) -> Check:
    where = data_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    needed = parameters * CHECKPOINT_BYTES
    detail = f"{needed / GIB:.2f} GiB for checkpoints in {data_dir}, {free / GIB:.1f} GiB free"
    if needed > free:
        return Check("disk", "fail", detail, "free space there, or pass --data-dir on a larger disk")
    return Check("disk", "ok", detail)


def announced(cfg: NodeConfig) -> Check:
    host = announce_host(cfg.grpc_host, cfg.announce_host)
    remote = [m for m in cfg.bootstrap if not any(part in m for part in _LOOPBACK)]
    if host.startswith(_LOOPBACK) and remote:
        return Check(
            "announced address",
            "fail",
            f"this node announces {host}, which peers on other machines (the bootstrap {remote[0]}) cannot dial",
            "pass --grpc-host 0.0.0.0 (and --announce-host with this machine's public address), and "
            "--dht-host-maddrs /ip4/0.0.0.0/tcp/PORT",
        )
    dht_loopback = all(any(part in m for part in _LOOPBACK) for m in cfg.dht_host_maddrs)
    if dht_loopback and remote and not cfg.dht_announce_maddrs:
        return Check(
            "announced address",
            "fail",
            f"the DHT listens on loopback only ({', '.join(cfg.dht_host_maddrs)}) while the bootstrap is remote",
            "pass --dht-host-maddrs /ip4/0.0.0.0/tcp/PORT (and --dht-announce-maddrs with the public address)",
        )
    return Check("announced address", "ok", f"peers dial {host}")


def grpc_port(cfg: NodeConfig) -> Check:
    if cfg.grpc_port == 0:
        return Check("gRPC port", "ok", "an ephemeral port")
    host = "0.0.0.0" if cfg.grpc_host in ("", "0.0.0.0") else cfg.grpc_host
    with socket.socket() as probe:
        try:
            probe.bind((host, cfg.grpc_port))
        except OSError as error:
            return Check(
                "gRPC port",
                "fail",
                f"cannot listen on {host}:{cfg.grpc_port}: {error.strerror}",
                "another process holds it: stop it or pass another --grpc-port",
            )
    return Check("gRPC port", "ok", f"{host}:{cfg.grpc_port} is free")


def local_checks(cfg: NodeConfig, device: str, parameters: int, on_gpu: bool) -> list[Check]:
    checks = [torch_build(device), host_memory(parameters, on_gpu)]
    if on_gpu and torch.cuda.is_available():
        checks.append(device_memory(parameters))
    return [*checks, disk(cfg.data_dir, parameters), announced(cfg), grpc_port(cfg)]


def log_local_checks(cfg: NodeConfig, device: str, parameters: int, on_gpu: bool) -> list[Check]:
    """`join`'s start: this machine's checks as one block, a warning when any is not ok (nothing is refused on
    them: swap, or memory freed by other processes, may make it fit)."""
    checks = local_checks(cfg, device, parameters, on_gpu)
    block = "\n".join(c.line() for c in checks)
    if all(c.level == "ok" for c in checks):
        log.info("this machine (noloco-node doctor checks the network too):\n%s", block)
    else:
        log.warning("this machine has problems for this run (noloco-node doctor checks the network too):\n%s", block)
    return checks
