"""The listening socket `serve` answers on: bound before the model loads (a port in use fails
at once), its connections tracked so that stopping ends the idle ones and lets the others
finish their answers."""

from __future__ import annotations

import errno
import http.server
import socket
import threading
from typing import Any


def listen(host: str, port: int) -> http.server.ThreadingHTTPServer:
    """The bound, listening socket of a server not yet answering (connections wait in its
    backlog): taken before the model loads, so a port in use fails at once, as a ValueError
    naming the setting to change."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"PORT must be an integer between 0 and 65535, got {port!r}.")
    try:
        return HTTPServer((host, port), http.server.BaseHTTPRequestHandler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} is in use; set --gin.PORT") from e
        raise ValueError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); set --gin.HOST or --gin.PORT"
        ) from e


class HTTPServer(http.server.ThreadingHTTPServer):
    # Handler threads are joined by server_close() (none is cut off at exit); stop_reading()
    # first ends those still waiting for a request (an idle connection, a preconnect).
    daemon_threads = False
    block_on_close = True
    request_queue_size = 128  # many clients connecting at once are queued, not reset

    def __init__(self, *args: Any, **kwargs: Any):
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def stop_reading(self) -> None:
        """Shuts the reading side of every open connection: a handler waiting for a request
        sees it end; one writing its answer goes on."""
        with self._connections_lock:
            for connection in self._connections:
                try:
                    connection.shutdown(socket.SHUT_RD)
                except OSError:
                    pass  # the client has gone already
