"""``noloco-node train``: one replica alone, with solo outer steps (NoLoCo with a group of one), checkpointed.

With G = {i} the outer step (arXiv 2506.10911, eq. 3-5; docs/architecture.md) is still well defined: the replica
moves towards its own fast weights with momentum. The run is the one inner loop (training/loop.py) with a solo
outer step between phases; the full state is checkpointed every ``checkpoint_every`` inner steps and at the end,
and a run started again on the same folder continues bit-exactly from the last checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from noloco_node import algorithm
from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig
from noloco_node.data.corpus import ReplicaShard, validation_batches
from noloco_node.model.checkpoint_file import load_checkpoint, save_checkpoint
from noloco_node.model.run_model import run_model
from noloco_node.training.loop import InnerLoop
from noloco_node.training.replica import Replica, StepLoss

log = logging.getLogger(__name__)


def solo_outer_step(replica: Replica, outer_cfg: OuterConfig) -> None:
    """The outer step of a group of one (no partner answered, or no swarm at all)."""
    new_phi, new_delta = algorithm.noloco_pair_step(
        replica.outer_theta(),
        replica.phi,
        replica.delta,
        None,
        alpha=outer_cfg.alpha,
        beta=outer_cfg.beta,
        gamma=outer_cfg.effective_gamma,
    )
    replica.apply_outer_step(new_phi, new_delta)


def run_training(
    train_cfg: TrainConfig,
    outer_cfg: OuterConfig,
    data_cfg: DataConfig,
    *,
    checkpoint_dir: Path,
    checkpoint_every: int,
    fresh: bool = False,
    replica_index: int = 0,
    num_replicas: int = 1,
    eval_every: int = 0,
) -> Replica:
    """Train one replica alone: H inner steps, then a solo outer step, repeated; checkpoints every
    ``checkpoint_every`` inner steps and at the end. Started again on ``checkpoint_dir`` it resumes."""
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    corpus, source = run_model(data_cfg, train_cfg)
    shard = ReplicaShard(
        corpus.train, replica=replica_index, num_replicas=num_replicas, seq_len=train_cfg.seq_len, seed=train_cfg.seed
    )
    replica = Replica(source, train_cfg, [shard])
    val = validation_batches(
        corpus.validation,
        seq_len=train_cfg.seq_len,
        batch_size=train_cfg.eval_batch_size,
        num_batches=train_cfg.eval_batches,
    )
    algorithm.warn_on_unstable_hyperparameters(outer_cfg.alpha, outer_cfg.beta, outer_cfg.effective_gamma)
    checkpoint_path = checkpoint_dir / "checkpoint.pt"
    identity = {
        "model_source": source.record(),
        "train_config": train_cfg.model_dump(mode="json"),
        "tokenizer_json": corpus.tokenizer.json_text,  # so that export, eval and generate decode what it learnt
    }
    if checkpoint_path.exists() and not fresh:
        payload = load_checkpoint(checkpoint_path)
        if payload.get("model_source") != identity["model_source"]:
            raise ValueError(f"{checkpoint_path} was written for another model: {payload.get('model_source')}")
        replica.load_state_dict(payload["replica"])
        log.info(
            "resumed from %s at inner step %d (outer step %d)", checkpoint_path, replica.inner_step, replica.outer_step
        )
    else:
        log.info("starting a fresh run: %s, model %s", corpus.description, source.name)
    eval_every = eval_every or train_cfg.inner_steps
    recent: list[float] = []
    started = time.perf_counter()

    def at_phase_end(step: int) -> bool:
        return step % train_cfg.inner_steps == 0 or step >= train_cfg.total_steps

    def evaluate_and_save(step: int) -> None:
        """Evaluation and checkpoints fall on inner steps of their own, not only on phase ends."""
        finished = step == train_cfg.total_steps
        if step % eval_every == 0 or finished:
            val_loss = replica.evaluate(val)
            log.info(
                "step %d/%d outer %d  train %.4f  val %.4f (ppl %.3f)  lr %.2e  %.1fs",
                step,
                train_cfg.total_steps,
                replica.outer_step,
                sum(recent) / len(recent),
                val_loss,
                math.exp(val_loss),
                replica.current_lr,
                time.perf_counter() - started,
            )
            recent.clear()
        if step % checkpoint_every == 0 or finished:
            save_checkpoint(checkpoint_path, {**identity, "replica": replica.state_dict()})

    def after_step(replica: Replica, loss: StepLoss, _seconds: float) -> None:
        recent.append(float(loss))
        if not at_phase_end(replica.inner_step):
            evaluate_and_save(replica.inner_step)

    loop = InnerLoop(
        replica, total_steps=train_cfg.total_steps, inner_steps=train_cfg.inner_steps, after_step=[after_step]
    )
    for _phase in loop.phases():
        solo_outer_step(replica, outer_cfg)
        evaluate_and_save(replica.inner_step)  # a phase's last step: after its outer step
    return replica
