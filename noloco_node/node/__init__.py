"""The daemon: the composition root that starts, supervises and stops a swarm member's components."""
