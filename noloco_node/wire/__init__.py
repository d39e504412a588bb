"""Payloads on the wire: manifests, chunked frames, dtypes, checksums and the receiving side's checks."""
