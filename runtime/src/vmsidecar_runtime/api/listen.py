"""The health listener's setting (``serve --health-listen``, ``VMSIDECAR_HEALTH_LISTEN``) and its parser.

Apart from ``health``, which imports aiohttp: ``serve`` reads its arguments before the API's
modules are imported (they load while the guest boots, ``serve.py``).
"""

from __future__ import annotations

import ipaddress

from vmsidecar_contract.errors import HostError

HEALTH_LISTEN_ENV = "VMSIDECAR_HEALTH_LISTEN"
HEALTH_LISTEN_FLAG = "--health-listen"


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[ADDR]:PORT``) → (host, port); port 0 picks a free one.

    :raise HostError: naming the flag, the value and the form it takes.
    """
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
        if not sep or not host or not 0 <= port <= 65535:
            raise ValueError(value)
        ipaddress.ip_address(host)
    except ValueError:
        raise HostError(
            f"{HEALTH_LISTEN_FLAG} {value!r} is not HOST:PORT with an IP address and a port 0-65535 (e.g. 0.0.0.0:8081 "
            f"in a pod, 127.0.0.1:8081 on a laptop, [::]:8081; also {HEALTH_LISTEN_ENV})"
        ) from None
    return host, port
