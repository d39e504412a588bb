"""RL post-training with shared rollouts (`noloco-node rl`; SAPO, arXiv 2509.08721): tasks, policy, GRPO, the
rollouts a node serves and fetches, its trainer and its composition root."""
