"""File descriptors: the limit a node raises at start, and the share of it that peers' connections may use.

Every TCP connection to the gRPC port holds a descriptor. Under a plain shell's default limit of 1,024, idle
connections that never sent a byte once made a node's checkpoint write fail with EMFILE, and the node exited. So a
node raises its soft limit to the hard one at start (allowed without privileges), and lets peers' connections use
at most about half of what it then has: the rest stays for checkpoints, the DHT, the status endpoint and data
files. gRPC closes connections beyond that budget, and ones that finish no handshake within seconds
(rpc/service.start_server).
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

RESERVED = 256  # descriptors kept for the node's own files, threads' pipes, the DHT helper and HTTP clients
MIN_CONNECTIONS, MAX_CONNECTIONS = 16, 4096


def raise_descriptor_limit() -> int:
    """Raise the soft limit on open files to the hard one where the system allows; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as error:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, wanted, error)
    if soft < 4 * RESERVED:
        log.warning(
            "the open-file limit is %d: peers' connections are capped at %d; raise it (ulimit -n) for a busy swarm",
            soft,
            connection_budget(soft),
        )
    return soft


def connection_budget(descriptor_limit: int) -> int:
    """How many connections peers may hold open at once, given the open-file limit."""
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, (descriptor_limit - RESERVED) // 2))
