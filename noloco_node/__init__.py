"""noloco-node: a decentralized, peer-to-peer training node for language models (NoLoCo, arXiv 2506.10911)."""

__version__ = "0.1.0"
