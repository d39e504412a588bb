"""Local swarms of real node processes: the user's `swarm` command, benchmarks and tests."""
