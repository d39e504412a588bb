"""Membership, identity, TLS, caller proofs and the admission of payloads (the norm bound)."""
