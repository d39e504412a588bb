"""The /status document of an RL node (`noloco-node rl`, noloco_node/rl/): reward curves, local and from the
swarm, per task family, and the rollouts it served, fetched, used and refused. The page (web/rl.html) draws it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from noloco_node.observability.status import Health


class RewardPoint(BaseModel):
    """One round (one GRPO update) of one node."""

    round: int
    time: float = Field(description="Unix time.")
    local_reward: float | None = Field(description="Mean reward of this node's own completions (None: none).")
    external_reward: float | None = Field(
        description="Mean reward, as this node scores them, of the peers' completions it trained on (None: none)."
    )
    local_groups: int
    external_groups: int
    loss: float = Field(description="The GRPO loss of the update.")
    by_family: dict[str, float] = Field(default_factory=dict, description="Mean local reward per task family.")


class FamilyStatus(BaseModel):
    family: str
    local_rollouts: int = Field(description="Questions of this family this node generated and trained on.")
    external_rollouts: int = Field(description="Peers' questions of this family this node trained on.")
    local_reward: float | None = Field(description="Mean over the last 10 rounds' local completions.")
    external_reward: float | None = Field(description="Mean over the last 10 rounds' external completions.")
    eval_reward: float | None = Field(None, description="The latest greedy evaluation on held-out questions.")


class EvalPoint(BaseModel):
    round: int
    family: str
    reward: float = Field(description="Mean reward of greedy answers to the family's held-out questions.")
    answer_nll: float = Field(description="Mean negative log-likelihood per token of their reference answers.")


class RolloutPeer(BaseModel):
    peer_id: str
    address: str
    rollout_round: int = Field(description="The newest round its manifest (DHT record) names.")
    families: list[str]
    record_age_seconds: float
    rollouts_used: int = Field(0, description="Its rollouts this node trained on.")
    reward: float | None = Field(None, description="Their mean reward, as this node's verifier scored them.")


class RolloutNodeStatus(BaseModel):
    schema_version: Literal[1] = 1
    kind: Literal["rl"] = "rl"
    peer_id: str
    run_name: str
    run_fingerprint: str
    version: str
    model: str
    address: str
    status_url: str
    health: Health
    round: int = Field(description="Rounds (updates) done.")
    rounds: int = Field(description="Rounds this node runs.")
    local: int = Field(description="I: own rollouts per update.")
    external: int = Field(description="J: peers' rollouts per update.")
    group_size: int
    families: list[str]
    rewards: list[RewardPoint] = Field(description="The last rounds (at most 500), oldest first.")
    cumulative_local_reward: float = Field(description="Sum over rounds of the mean local reward.")
    by_family: list[FamilyStatus]
    evaluations: list[EvalPoint] = Field(default_factory=list)
    rollouts_served: int = Field(description="Rollouts (groups) handed to peers.")
    rollouts_fetched: int = Field(description="Peers' rollouts fetched and accepted.")
    rollouts_used: int = Field(description="Peers' rollouts trained on.")
    rollouts_stale: int = Field(description="Peers' rollouts dropped unused, older than --max-rollout-age.")
    rollouts_refused: dict[str, int] = Field(description="Fetched batches refused, by reason.")
    fetch_failures: dict[str, int] = Field(description="Fetches that failed, by gRPC status.")
    peers: list[RolloutPeer]
