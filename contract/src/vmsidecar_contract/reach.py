"""Addresses a lease may not make the pod reach on its word: the pod's loopback (the exporter's
gRPC port, health ports), link-local addresses and the IPv6 ones of the cloud metadata services,
unspecified and multicast ones, and each inside an IPv6 address that embeds it. The exporter checks the URLs a lease holder gives it, the runtime the redirects a
registry answers; both resolve names first (``docs/security.md``, row 12)."""

from __future__ import annotations

import ipaddress
import socket

#: the cloud metadata services' IPv6 addresses (AWS, GCP): unique-local, which no test above catches
METADATA_V6 = ("fd00:ec2::254", "fd20:ce::254")
_METADATA_V6 = frozenset(ipaddress.IPv6Address(a) for a in METADATA_V6)
#: IPv6 /96 networks whose last 32 bits are an IPv4 address some part of the pod's network connects:
#: IPv4-compatible, IPv4-mapped, NAT64's well-known prefix (the NIC guard judges the same)
EMBEDDING_V6 = ("::", "::ffff:0:0", "64:ff9b::")
_EMBEDDING = tuple(ipaddress.IPv6Network(f"{prefix}/96") for prefix in EMBEDDING_V6)
#: "this network": Linux connects 0.0.0.0 to the host itself
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")


def _local(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip in _METADATA_V6
            or ip in _THIS_NETWORK)


def is_pod_local(address: str) -> bool:
    """Whether the IP ``address`` (an IPv6 zone, and IPv4 addresses inside IPv6 ones, allowed) is one a
    lease may not reach."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if _local(ip):
        return True
    if isinstance(ip, ipaddress.IPv6Address) and any(ip in net for net in _EMBEDDING):
        return _local(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return False


def resolves_to_pod(host: str, port: int) -> bool:
    """Whether the name or IP ``host`` is, or resolves to, such an address (blocking: a resolver
    call). A name that does not resolve is not: its fetch fails on its own and says so."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return False
    return any(is_pod_local(str(info[4][0])) for info in infos)
