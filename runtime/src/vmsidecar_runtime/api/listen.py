"""The health listener's setting (``serve --health-listen``, ``VMSIDECAR_HEALTH_LISTEN``) and its parser.

Apart from ``health``, which imports aiohttp: ``serve`` reads its arguments before the API's
modules are imported (they load while the guest boots, ``serve.py``).
"""

from __future__ import annotations

from vmsidecar_contract import listen
from vmsidecar_contract.errors import HostError

HEALTH_LISTEN_ENV = "VMSIDECAR_HEALTH_LISTEN"
HEALTH_LISTEN_FLAG = "--health-listen"


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[ADDR]:PORT``) → (host, port); port 0 picks a free one.

    :raise HostError: naming the flag, the value and the form it takes.
    """
    try:
        return listen.parse_listen(value, flag=HEALTH_LISTEN_FLAG, env=HEALTH_LISTEN_ENV, example_port=8081)
    except ValueError as e:
        raise HostError(str(e)) from None
