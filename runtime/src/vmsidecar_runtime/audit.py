"""The audit trail: one JSON object per line on stderr, logger ``vmsidecar.audit`` (docs/operations.md).

A line per state-changing API call (``api/audit.py``) and a summary per lease at its end
(``controller/vm.py``). Whatever a caller sent is written only through :func:`redact`: no
userinfo, no query string (a presigned URL's signature is a credential), bounded in length. The
lines are JSON whatever ``--log-format`` says: a security team's tooling parses them.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any
from urllib.parse import urlsplit

AUDIT_LOGGER = "vmsidecar.audit"
log = logging.getLogger(AUDIT_LOGGER)
#: a reference longer than this is cut (a lease holder's megabyte-long reference must not flood the log)
MAX_TARGET = 512
#: ``user:password@`` in free text (an error message quoting what a caller sent)
#: (at the start of a URL's authority or of a quoted reference: ``repo:tag@sha256:`` is no userinfo)
_USERINFO = re.compile(r"(?:(?<=://)|(?<=[\s'\"(])|^)[^\s'\"/@:]+:[^\s'\"/@]+@")


def redact(reference: str | None) -> str | None:
    """``reference`` with no credentials: a URL loses its userinfo, query and fragment; a registry
    reference the ``user:password@`` some people prefix it with."""
    if reference is None:
        return None
    text = reference
    if "://" in text:
        try:
            parts = urlsplit(text)
            host = parts.hostname or ""
            port = f":{parts.port}" if parts.port else ""
        except ValueError:  # a malformed port or bracket: keep only the scheme
            return text.partition("://")[0] + "://<unparsable>"
        text = f"{parts.scheme}://{host}{port}{parts.path}" + ("?<redacted>" if parts.query else "")
    else:
        head, slash, tail = text.partition("/")
        if "@" in head:  # userinfo before the registry host (a digest comes after the first /)
            head = head.rpartition("@")[2]
        text = head + slash + tail
    return text if len(text) <= MAX_TARGET else text[:MAX_TARGET] + "…"


def scrub(text: str) -> str:
    """``text`` (a message that may quote a caller's reference) with every ``user:password@`` cut out."""
    return _USERINFO.sub("<redacted>@", text)


def write(**fields: Any) -> None:
    """One audit line."""
    log.info("%s", json.dumps({"time": round(time.time(), 3), "logger": AUDIT_LOGGER, **fields}, default=str))


def setup(stream: Any = None) -> None:
    """Audit lines go to stderr as bare JSON, beside (not through) the runtime's other log lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
