"""Listening sockets, bound before any slow start-up work so that a port in use fails
at once (before a model loads or downloads)."""

from __future__ import annotations

import errno
import socket

from engine.errors import StartError
from engine.settings import split_hostport


def parse_address(text: str, default_port: int, *, what: str) -> tuple[str, int]:
    try:
        return split_hostport(text, default_port)
    except ValueError as exc:
        raise StartError(f"{what}: {exc}", code="bad_address") from None


def bind(host: str, port: int, *, what: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartError(f"{what} port {host}:{port} is in use; stop the other process "
                             "or choose another port", code="port_in_use") from None
        raise StartError(f"cannot listen on {host}:{port} for {what}: {exc.strerror}",
                         code="cannot_listen") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bound_address(sock: socket.socket) -> tuple[str, int]:
    name = sock.getsockname()
    return str(name[0]), int(name[1])
