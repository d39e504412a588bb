"""The `noloco-node` command line."""
