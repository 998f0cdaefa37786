"""The HTTP policy of registry requests, on top of oras-py: auth, TLS, timeouts and bounded retries.

oras-py (``oras.provider.Registry``) does the URLs, the token/anonymous auth dance, blob
existence checks and chunked blob uploads. :class:`OrasRegistry` adds what it lacks for our use:

* ``do_request`` with a bounded retry (3 tries, < 10 s in total) and socket timeouts: oras-py's
  own retry sleeps 3 s, 5 s, 11 s, 29 s, 83 s for an unreachable host and sets no timeout;
* registries that answer 401 with a ``Basic`` challenge (oras' token backend only does Bearer).

What is asked of the registry, and how its answers become vmsidecar errors, is :mod:`.registry`.
"""

from __future__ import annotations

import os
import time

import oras.auth
import oras.auth.utils
import oras.provider
import requests
import requests.adapters

ENV_USERNAME = "VMSIDECAR_REGISTRY_USERNAME"
ENV_PASSWORD = "VMSIDECAR_REGISTRY_PASSWORD"

CONNECT_TIMEOUT = 2.5
READ_TIMEOUT = 60.0
TRIES = 3
BACKOFF = (0.3, 1.0)


def resolve_credentials(credentials: tuple[str, str] | None) -> tuple[str, str] | None:
    """The argument, else ``VMSIDECAR_REGISTRY_USERNAME``/``_PASSWORD`` from the environment."""
    if credentials:
        return credentials
    user, password = os.environ.get(ENV_USERNAME), os.environ.get(ENV_PASSWORD)
    return (user, password) if user and password else None


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """Requests' adapter with our socket timeouts wherever the caller gave none (oras-py never does)."""

    def send(self, request, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = (CONNECT_TIMEOUT, READ_TIMEOUT)
        return super().send(request, **kwargs)


class OrasRegistry(oras.provider.Registry):
    """oras-py's registry with our request policy (see the module docstring).

    Why a subclass: oras-py has no hook for a request policy. Its ``do_request`` retries for
    minutes with no socket timeout and cannot answer a ``Basic`` challenge, and it is the one
    method its ``upload_blob``/``blob_exists``/``chunked_upload`` send through, so we override it.
    Everything read here is either set by this class (``_verify``, ``_basic``, ``_basic_accepted``)
    or oras' public API (constructor arguments, ``session``, ``auth`` with ``set_basic_auth``,
    ``token``, ``get_auth_header`` and ``authenticate_request``), never oras' private state: that
    is what lets runtime/pyproject.toml accept a range of oras versions.
    """

    def __init__(
        self,
        hostname: str,
        *,
        plain_http: bool,
        credentials: tuple[str, str] | None,
        tls_verify: bool = True,
    ) -> None:
        super().__init__(hostname=hostname, insecure=plain_http, tls_verify=tls_verify)
        adapter = _TimeoutAdapter()
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._verify = tls_verify
        self._basic = oras.auth.utils.get_basic_auth(*credentials) if credentials else None
        self._basic_accepted = False  # the registry took our Basic header: send it up front
        if credentials:
            self.auth.set_basic_auth(*credentials)  # for oras' Bearer token requests

    def do_request(  # type: ignore[override]
        self,
        url: str,
        method: str = "GET",
        data: dict | bytes | None = None,
        headers: dict | None = None,
        json: dict | None = None,
        stream: bool = False,
    ) -> requests.Response:
        """Send one request with our auth, retrying only an unreachable registry, briefly.

        :raise Unreachable: no answer after :data:`TRIES` tries.
        :raise requests.exceptions.SSLError: TLS failed (never retried).
        """
        for attempt in range(TRIES):
            try:
                return self._send_with_auth(url, method, data, dict(headers or {}), json, stream)
            except requests.exceptions.SSLError:
                raise  # a certificate problem is not "unreachable" and retrying cannot fix it
            except (requests.ConnectionError, requests.Timeout) as exc:
                if attempt == TRIES - 1:
                    raise Unreachable(str(exc)) from exc
                time.sleep(BACKOFF[attempt])
        raise AssertionError("unreachable")

    def _send_with_auth(
        self, url: str, method: str, data: dict | bytes | None, headers: dict, json: dict | None, stream: bool
    ) -> requests.Response:
        """Send once, answering a Basic or Bearer challenge by sending again with credentials."""
        auth = self.auth
        if isinstance(auth, oras.auth.TokenAuth) and auth.token is not None:
            headers.update(auth.get_auth_header())
        elif self._basic and self._basic_accepted:
            headers["Authorization"] = f"Basic {self._basic}"

        def send() -> requests.Response:
            return self.session.request(
                method, url, data=data, json=json, headers=headers, stream=stream, verify=self._verify
            )

        response = send()
        if response.status_code not in (401, 403):
            return response
        challenge = response.headers.get("Www-Authenticate", "")
        if challenge.lower().startswith("basic"):
            if not self._basic or self._basic_accepted:
                return response
            headers["Authorization"] = f"Basic {self._basic}"
            response.close()
            response = send()
            self._basic_accepted = response.status_code not in (401, 403)
            return response
        if not challenge:
            return response
        new_headers, changed = auth.authenticate_request(response, headers)
        if not changed:
            return response
        headers = new_headers
        response.close()
        response = send()
        if response.status_code == 403:
            new_headers, changed = auth.authenticate_request(response, headers, refresh=True)
            if changed:
                headers = new_headers
                response = send()
        return response


class Unreachable(Exception):
    """No answer from the registry after :data:`TRIES` tries (:mod:`.registry` words the error)."""
