"""Who blends with whom: the pairing strategies (sync, overlap) and the per-peer policy."""
