"""``HOST:PORT`` of a TCP listener given on a command line (the runtime's health listener, the
exporter's metrics listener): one parser, so both accept and refuse the same forms."""

from __future__ import annotations

import ipaddress


def parse_listen(value: str, *, flag: str, env: str, example_port: int) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[ADDR]:PORT``) → (host, port); port 0 picks a free one.

    :raise ValueError: naming ``flag`` (and ``env``, its variable), the value and the form it takes.
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
        raise ValueError(
            f"{flag} {value!r} is not HOST:PORT with an IP address and a port 0-65535 (e.g. 0.0.0.0:{example_port} "
            f"in a pod, 127.0.0.1:{example_port} on a laptop, [::]:{example_port}; also {env})"
        ) from None
    return host, port
