"""A multi-process member's layout on a machine (training/data_parallel.py): which device each rank trains on and
which collective backend follows from it. The GPU counts are patched: the logic is the same on any machine, and
on the H100 a two-rank member on one GPU failed with an invalid device (cuda:1) before it was refused by name."""

from __future__ import annotations

import pytest
import torch

from noloco_node.training.data_parallel import DataParallel, DataParallelError


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_each_rank_takes_its_own_gpu_and_the_collectives_run_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    rank = DataParallel(rank=1, world_size=2, local_rank=1)
    assert rank.device("auto") == "cuda:1" and rank.on_gpu
    assert rank.collective_device == torch.device("cuda:1")


def test_more_ranks_than_gpus_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    rank = DataParallel(rank=1, world_size=2, local_rank=1)
    with pytest.raises(DataParallelError, match=r"1 GPU\(s\).*--nproc-per-node 1 at most.*--device cpu"):
        rank.device("cuda")
    assert not rank.on_gpu


def test_ranks_told_to_train_on_the_cpu_use_gloo_on_the_host_even_beside_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    rank = DataParallel(rank=1, world_size=2, local_rank=1)
    assert rank.device("cpu") == "cpu" and not rank.on_gpu
    assert rank.collective_device == torch.device("cpu")  # before: cuda:1, and NCCL, whatever the settings said
