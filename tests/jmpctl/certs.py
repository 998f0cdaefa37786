"""A throw-away self-signed TLS certificate for the test controller.

Jumpstarter 0.9.0 always dials the controller and the router over TLS
(``grpc.aio.secure_channel`` with access-token call credentials); ``tls.insecure``
only skips *verification*, so the server still needs a certificate. The cheapest
trustworthy option is one self-signed certificate valid for 127.0.0.1/localhost,
handed to exporters and clients as ``tls.ca`` (base64 PEM).
"""

from __future__ import annotations

import base64
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SelfSigned:
    cert_pem: bytes
    key_pem: bytes

    @property
    def ca_b64(self) -> str:
        """The value for ``tls.ca`` in exporter and client configs."""
        return base64.b64encode(self.cert_pem).decode()


def make_self_signed(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> SelfSigned:
    """Generate an EC P-256 key and a 2-day self-signed certificate with the ``openssl`` CLI."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    san = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", "/CN=jmpctl", "-addext", f"subjectAltName={san}"],
        check=True, capture_output=True,
    )
    return SelfSigned(cert.read_bytes(), key.read_bytes())
