"""Whether ``umbra serve`` can listen where it is told, asked before it starts anything.

uvicorn binds its socket once the database is up, migrated and the sweeper
started, and a failure there was its own line, ``[Errno -2] Name or service
not known``, naming neither the address nor the setting that gave it, after
migrating a database the server then did not serve. Here the listen address
is resolved and bound as uvicorn's event loop will bind it (asyncio's
``create_server``: every address the name resolves to, ``SO_REUSEADDR``, IPv6
sockets IPv6 only) and let go at once, before anything else is done; a
failure is a :class:`~umbra.settings.SettingsError` naming the variable (or
the flag) to change. The socket is not kept: listening from here on would
take connections nobody answers while the database starts and migrates.
"""

from __future__ import annotations

import errno
import socket

from .settings import SettingsError


def check_listen(host: str, port: int, *, host_name: str = "UMBRA_HOST", port_name: str = "UMBRA_PORT") -> None:
    """Refuse, naming ``host_name`` or ``port_name``, an address this process could not listen on."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SettingsError(f"{host_name} {host!r} does not resolve to an address ({exc.strerror})") from None
    for family, kind, proto, _, address in dict.fromkeys(found):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise SettingsError(_refusal(exc, host, port, address[0], host_name, port_name)) from None


def _refusal(exc: OSError, host: str, port: int, address: str, host_name: str, port_name: str) -> str:
    where = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"{port_name} {port} is in use on {where} by another process: stop it or choose another port"
    if exc.errno == errno.EADDRNOTAVAIL:
        said = f"{host!r}" if host == address else f"{host!r} ({address})"
        return f"{host_name} {said} is not an address of this machine: give one of its own, or 0.0.0.0 or :: for every interface"
    if exc.errno == errno.EACCES:
        return f"{port_name} {port} may not be listened on by this user on {where} (ports below 1024 need privileges)"
    return f"{host_name} {host!r} and {port_name} {port} cannot be listened on ({where}: {exc.strerror})"
