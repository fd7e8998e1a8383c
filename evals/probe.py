"""A small JSON document from a server (``GET /v1/models``), bounded whatever the server does.

urllib's ``urlopen`` follows redirects (to any host), its timeout bounds each socket read rather
than the request (a server trickling a byte a second never times out), and ``read()`` takes the
whole body (a 100 MB or endless answer fills memory). Here: no redirect is followed (it is an
error naming where it pointed), a timer cuts the connection at the deadline whatever phase the
request is in, and at most ``MAX_BYTES`` are read.
"""

from __future__ import annotations

import http.client
import socket
import threading
from urllib.parse import urlsplit

from quant.errors import QuantgateError
from quant.safe_files import parse_json

MAX_BYTES = 8 << 20  # /v1/models of a server with a few models is a few kB


class ProbeError(QuantgateError, OSError):
    """The server did not give a usable answer; the message says what it did instead."""


def get_json(url: str, timeout: float, max_bytes: int = MAX_BYTES):
    """The JSON value at ``url`` (HTTP 200 only), within ``timeout`` seconds in all."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProbeError(f"{url}: not an http(s) URL")
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()
    sockets = []  # the connection's socket: http.client drops its own reference once a reply will close it

    def cut() -> None:  # unblocks whatever read is waiting
        expired.set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        connection.connect()  # itself bounded by ``timeout``
        sockets.append(connection.sock)
        connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""))
        response = connection.getresponse()
        if 300 <= response.status < 400:
            raise ProbeError(f"{url} answered HTTP {response.status}, a redirect to "
                             f"{response.getheader('Location', '?')!r}; redirects are not followed: give the "
                             "server's own address")
        body = response.read(max_bytes + 1)
        if len(body) > max_bytes:
            raise ProbeError(f"{url} answered more than {max_bytes >> 20} MiB; not an OpenAI-compatible server's "
                             "answer")
        if response.status != 200:
            raise ProbeError(f"{url} answered HTTP {response.status}")
        return parse_json(body, url, ProbeError, "not an OpenAI-compatible server's answer")
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise ProbeError(f"{url} gave no complete answer within {timeout:g} s") from None
        if isinstance(exc, ProbeError):
            raise
        raise ProbeError(f"{url}: {exc}") from None
    finally:
        timer.cancel()
        connection.close()
