"""The training loop: the replica (inner Adam, outer state), checkpoints, the multi-GPU member."""
