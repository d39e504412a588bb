"""Finding the run's peers: the Hivemind DHT records, the bootstrap peer, the reachability check."""
