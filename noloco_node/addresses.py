"""What an address is to a node: the one spelling a DHT record may give it, and the network group that counts as
one machine wherever peers are weighed.

Keys and names cost an attacker nothing; addresses cost it something. So a peer is weighed by the address this node
dials or is called from, never by a string the peer chose:

- **One spelling per address.** A record's address is ``IP:port`` with the IP written as ``ipaddress`` writes it
  (IPv6 in brackets): no DNS names, no ``localhost``, no zero-padded octets, no IPv4-mapped IPv6. Any other
  spelling of a record's address makes the record malformed (discovery/dht.py). The node dials exactly that IP, so
  what it weighs is what it reaches.
- **A network group is one machine.** A public IPv4 address counts as its /24 (``IPV4_PREFIX``), a public IPv6
  address as its /48 (``IPV6_PREFIX``: the block a site is given, so every address of one /64, or of the /56 a home
  line gets, is one group). Loopback, private and link-local addresses are each a group of their own: a LAN
  swarm's machines are many to each other, and an outsider on the internet cannot be reached at such an address.
  Honest members in one group (a shared NAT, one hosting subnet) share its weight, its limits and its bars.
- **A member reached through relays has no address of its own** to weigh: peers dial its relay, and the address
  its record names is whatever it wrote. Every such member counts as one group together (``PeerRecord.
  network_group``, discovery/dht.py): free records that say "reach me through a relay" buy one group, not one
  per address they name. Its calls in are weighed by the address its relay saw (below).

Every place that weighs peers uses ``network_group``: partner choice and the stranger share (pairing/standing.py),
the swarm's front and donors (node/catch_up.py), relays (discovery/tunnels.py), the RL fetcher (rl/fetcher.py), and
the slots and bars of calls in (rpc/admission.py, keyed by the group of the address the call came from).
"""

from __future__ import annotations

import functools
import ipaddress

IPV4_PREFIX = 24
IPV6_PREFIX = 48


def canonical_address(address: str) -> str | None:
    """Why ``address`` (``host:port``) is not a record's address, or None when it is: an IP literal in its canonical
    spelling and a port in 1-65535."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or port != str(int(port)):
        return f"{address!r} is not host:port"
    bracketed = host.startswith("[") and host.endswith("]")
    literal = host[1:-1] if bracketed else host
    problem = ip_literal_problem(literal)
    if problem is not None:
        return problem
    if (":" in literal) != bracketed:
        return f"{host!r}: an IPv6 address is written in brackets, an IPv4 address without"
    return None


def ip_literal_problem(host: str) -> str | None:
    """Why ``host`` cannot be announced (a name, or a second spelling of an IP), or None: what a node announces is
    what its record says, and records name one IP in one spelling."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host!r} is not an IP address: peers weigh members by the address they dial, so announce the IP"
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return f"{host!r} is an IPv4 address written as IPv6: give {ip.ipv4_mapped}"
    if str(ip) != host:
        return f"{host!r} is not written canonically: give {ip}"
    return None


def record_address(host: str, port: int) -> str:
    """The ``host:port`` a record gives for an announced IP (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_of_address(address: str) -> str:
    """The IP of a record's ``host:port`` (brackets taken off an IPv6 one)."""
    host = address.rpartition(":")[0] or address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@functools.lru_cache(maxsize=1 << 14)
def group_of_address(address: str) -> str:
    """The network group of a record's ``host:port`` (cached: standing asks it of every record in view, often)."""
    return network_group(host_of_address(address))


@functools.lru_cache(maxsize=1 << 14)
def network_group(host: str) -> str:
    """The group ``host`` (an IP, as a socket or a record gives it) counts as: ``203.0.113.0/24``,
    ``2001:db8:1::/48``, or the address itself for a loopback, private or link-local one. Anything that is not an IP
    (a tunnel's ``p2p:`` origin) is a group of its own. Cached: standing asks it of every record in view at each
    lookup, and parsing an address is most of what that costs."""
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        return host
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_private or ip.is_link_local:
        return str(ip)
    prefix = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))
