"""This machine's checks, before a node joins (node/doctor.py runs them with the network's; `join` prints them at
its start as one block, :func:`log_local_checks`): the torch build against the device (a GPU with a CPU build of
torch, or ``--device cuda`` that torch cannot use), host memory and device memory for the chosen model (the bytes
per parameter a node holds, node/memory.py), disk for its checkpoints, the announced address (a loopback address
cannot be dialed from another machine), the gRPC port free. Each check that fails says how to fix it.
"""

from __future__ import annotations

import logging
import math
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from noloco_node.config.models import MODEL_SIZES, ModelConfig, TrainConfig, model_config_for
from noloco_node.config.node_config import NodeConfig
from noloco_node.discovery.reachability import announce_host
from noloco_node.model.source import ModelSource
from noloco_node.node.memory import GIB, available_memory, host_bytes_per_parameter
from noloco_node.security.identity import KEY_FILE, IdentityError, NodeIdentity
from noloco_node.training.replica import resolve_device
from noloco_node.training.step_plan import fewest_ranks_to_fit, plan_for_memory

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


def step_plan_checks(train_cfg: TrainConfig, model_cfg: ModelConfig | None, memory_bytes: int) -> list[Check]:
    """The step plan the memory model gives a GPU of ``memory_bytes`` (training/step_plan.py), before anything is
    loaded: this run's size, and what every named size would get on that card. A node on a GPU refines it with a
    probe at start."""
    if model_cfg is None:
        return [Check("step plan", "ok", "a model from --init-from: its step is planned by a probe at start")]
    plan = plan_for_memory(model_cfg, train_cfg, memory_bytes)
    fits = []
    for size in MODEL_SIZES:
        other = model_config_for(size, vocab_size=model_cfg.vocab_size, max_seq_len=train_cfg.seq_len)
        unset = train_cfg.model_copy(update={"micro_batch": None})
        sized = plan_for_memory(other, unset, memory_bytes)
        if sized.micro_batch:
            fits.append(f"{size} micro-batch {sized.micro_batch}")
            continue
        sharded = fewest_ranks_to_fit(other, unset, memory_bytes)
        fits.append(
            f"{size} does not fit"
            + (f" (sharded over {sharded.ranks} such GPUs: micro-batch {sharded.micro_batch})" if sharded else "")
        )
    what_fits = Check(
        "what fits",
        "ok",
        f"a GPU of {memory_bytes / GIB:.0f} GiB, sequences of {train_cfg.seq_len} tokens, "
        f"batch {train_cfg.batch_size}: " + ", ".join(fits),
    )
    if plan.micro_batch == 0:
        sharded = fewest_ranks_to_fit(model_cfg, train_cfg, memory_bytes)
        shard_hint = (
            f", or shard it over {sharded.ranks} such GPUs (torchrun --nproc-per-node {sharded.ranks})"
            if sharded
            else ""
        )
        return [
            Check(
                "step plan",
                "fail",
                f"{model_cfg.num_layers}-layer model: " + "; ".join(plan.notes),
                f"pick a smaller --model or --seq-len (see what fits), or a GPU with more memory{shard_hint}",
            ),
            what_fits,
        ]
    return [Check("step plan", "ok", plan.summary() + " (memory model; a probe at start refines it)"), what_fits]


def identity(data_dir: Path) -> Check:
    """The node key in ``data_dir`` (security/identity.py): its peer id, and the standing peers gave that id, are
    tied to it, so it is the one file to back up; a missing one is made anew at start (a new peer id)."""
    path = data_dir / KEY_FILE
    if not path.exists():
        return Check(
            "identity",
            "warn",
            f"no node key at {path}: the first start creates one, and with it a new peer id",
            f"joining again after a reinstall? put the backed-up {KEY_FILE} there first (mode 600)",
        )
    try:
        peer_id = NodeIdentity.load_or_create(data_dir).peer_id
    except IdentityError as error:
        return Check(
            "identity", "fail", str(error), f"restore {KEY_FILE} from its backup, or remove it to start a new identity"
        )
    return Check("identity", "ok", f"peer id {peer_id} from {path}: keep a copy of this file (mode 600)")


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


def local_checks(
    cfg: NodeConfig, train_cfg: TrainConfig, source: ModelSource, on_gpu: bool, gpu_memory: int | None = None
) -> list[Check]:
    """This machine's checks; the step plan for this machine's GPU, or for a GPU of ``gpu_memory`` bytes (doctor
    --gpu-memory: what would fit on a card this machine does not have)."""
    parameters = sum(math.prod(shape) for _, shape in source.layout())
    checks = [torch_build(train_cfg.device), host_memory(parameters, on_gpu)]
    if gpu_memory is None and on_gpu and torch.cuda.is_available():
        gpu_memory = torch.cuda.get_device_properties(resolve_device(train_cfg.device)).total_memory
    if gpu_memory is not None:
        checks += step_plan_checks(train_cfg, getattr(source, "model_config", None), gpu_memory)
    return [*checks, disk(cfg.data_dir, parameters), announced(cfg), grpc_port(cfg)]


def nodes_together(parameters: int, on_gpu: bool, nodes: int, out_dir: Path) -> list[Check]:
    """A local swarm's nodes on one machine (``noloco-node swarm``): their host memory and checkpoints together.
    Each node's own check counts itself alone, so N nodes that each fit could still not fit together (two 1.3b
    nodes on a 125 GiB machine did not)."""
    per_node = parameters * host_bytes_per_parameter(on_gpu)
    needed, available = nodes * per_node, available_memory()
    checks = []
    if available is not None and needed > available:
        checks.append(
            Check(
                "host memory",
                "fail",
                f"{nodes} nodes x {per_node / GIB:.1f} GiB = {needed / GIB:.1f} GiB of host memory together, "
                f"{available / GIB:.1f} GiB available",
                "fewer --nodes, or a smaller --model",
            )
        )
    where = out_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    disk_needed, free = nodes * parameters * CHECKPOINT_BYTES, shutil.disk_usage(where).free
    if disk_needed > free:
        checks.append(
            Check(
                "disk",
                "fail",
                f"{nodes} nodes x {parameters * CHECKPOINT_BYTES / GIB:.1f} GiB of checkpoints = "
                f"{disk_needed / GIB:.1f} GiB in {out_dir}, {free / GIB:.1f} GiB free",
                "fewer --nodes, a smaller --model, or --out on a larger disk",
            )
        )
    return checks


def log_local_checks(cfg: NodeConfig, train_cfg: TrainConfig, source: ModelSource, on_gpu: bool) -> list[Check]:
    """`join`'s start: this machine's checks as one block, a warning when any is not ok (nothing is refused on
    them: swap, or memory freed by other processes, may make it fit)."""
    checks = local_checks(cfg, train_cfg, source, on_gpu)
    block = "\n".join(c.line() for c in checks)
    if all(c.level == "ok" for c in checks):
        log.info("this machine (noloco-node doctor checks the network too):\n%s", block)
    else:
        log.warning("this machine has problems for this run (noloco-node doctor checks the network too):\n%s", block)
    return checks
