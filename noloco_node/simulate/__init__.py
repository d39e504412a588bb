"""N replicas in one process: the algorithm study (NoLoCo against DiLoCo, DDP and solo)."""
