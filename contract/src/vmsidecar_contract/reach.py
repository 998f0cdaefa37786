"""Addresses a lease may not make the pod reach on its word: the pod's loopback (the exporter's
gRPC port, health ports), link-local addresses (the cloud metadata service), unspecified and
multicast ones. The exporter checks the URLs a lease holder gives it, the runtime the redirects a
registry answers; both resolve names first (``docs/security.md``, row 12)."""

from __future__ import annotations

import ipaddress
import socket


def is_pod_local(address: str) -> bool:
    """Whether the IP ``address`` (an IPv6 zone and IPv4-mapped forms allowed) is one a lease may not
    reach."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast


def resolves_to_pod(host: str, port: int) -> bool:
    """Whether the name or IP ``host`` is, or resolves to, such an address (blocking: a resolver
    call). A name that does not resolve is not: its fetch fails on its own and says so."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        return False
    return any(is_pod_local(str(info[4][0])) for info in infos)
