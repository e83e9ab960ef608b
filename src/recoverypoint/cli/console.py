"""``recoverypoint console``: the web console on its own, for a laptop or a bastion.

It binds to loopback and asks each browser for a token it prints at start (or one given
with ``--token`` or ``$RECOVERYPOINT_CONSOLE_TOKEN``). Another address needs
``--allow-remote``, and then a token always: ``--no-token`` is for loopback only.
Token holders are operators, or viewers with ``--read-only``.

It answers only requests whose ``Host`` is the address it is bound to (``localhost`` too,
on loopback) or a name given with ``--allowed-host``: a page of another site whose name
an attacker points at 127.0.0.1 (DNS rebinding) is the same origin as the console for the
browser, but sends its own name as the ``Host``, and is refused before anything else.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import secrets
import socket
from collections.abc import Callable, Sequence
from typing import Any

from ..admin import Admin
from ..exits import EXIT_OK, EXIT_USAGE, fail
from ._app import UsageError
from ._common import (
    Subparsers,
    add_database_options,
    add_stuck_after,
    address,
    admin_for,
    described,
)

DEFAULT_BIND = "127.0.0.1:8080"
TOKEN_ENV = "RECOVERYPOINT_CONSOLE_TOKEN"


def add_console(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "console",
        help="serve the web console of keys and staged jobs",
        description=described(__doc__),
    )
    parser.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_BIND}; port 0 picks a free one)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"the token visitors must give (default ${TOKEN_ENV}; else a new one, printed)",
    )
    parser.add_argument(
        "--no-token", action="store_true", help="no token (only on a loopback address)"
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="listen on an address other than loopback (a token is then required)",
    )
    parser.add_argument(
        "--read-only", action="store_true", help="visitors may look, never change a key"
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name browsers reach the console by, besides the address it is bound to "
        "(repeat for several; needed when bound to 0.0.0.0 or ::)",
    )
    add_database_options(parser, json=False)
    add_stuck_after(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

    except ImportError:
        return fail("console", EXIT_USAGE, "missing: pip install 'recoverypoint[console]'")
    try:
        host, port = address(args.bind, DEFAULT_BIND)
        token = _token(args, host)
        hosts = trusted_hosts(host, args.allowed_host)
        with admin_for(args) as ops:
            app = standalone(ops, token=token, read_only=args.read_only, hosts=hosts)
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(128)  # a browser opened at once waits in the backlog for the server
            shown = f"[{host}]" if ":" in host else host
            print(f"console on http://{shown}:{listener.getsockname()[1]}/", flush=True)
            if token is not None and token != args.token:
                print(f"token: {token}", flush=True)  # made here: nobody else knows it
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
            server.run(sockets=[listener])  # until SIGTERM or SIGINT
    except (UsageError, ValueError, OSError) as exc:
        return fail("console", EXIT_USAGE, str(exc))
    return EXIT_OK


def standalone(ops: Admin, *, token: str | None, read_only: bool, hosts: Sequence[str]) -> Any:
    """The console as ``recoverypoint console`` serves it (an ASGI app): behind its token
    (none only for ``--no-token``), and answering only the ``Host`` names ``hosts``."""
    from ..console import TokenLock, console
    from ..console.hosts import OwnHosts

    app: Any
    if token is None:
        app = console(ops, authorize=_anyone(read_only))
    else:
        lock = TokenLock(token, read_only=read_only)
        app = lock.guard(console(ops, authorize=lock.authorize))
    return OwnHosts(app, hosts)


def trusted_hosts(host: str, names: Sequence[str]) -> list[str]:
    """The ``Host`` names the console answers when bound to ``host``: that address (an
    IPv6 one in brackets, as a ``Host`` header writes it), ``localhost`` on loopback, and
    ``names``. Bound to every address, it cannot know its names: they must be given."""
    for name in names:
        if not _HOST_NAME.fullmatch(name):
            raise UsageError(f"--allowed-host takes a host name or address, no port: {name!r}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name, as --bind localhost gives it
        return [host.lower(), *names]
    if ip.is_unspecified and not names:
        raise UsageError(
            f"bound to every address ({host}), the console cannot tell its own names from "
            "another site's: name them with --allowed-host (e.g. --allowed-host ops.example.com)"
        )
    own = f"[{ip}]" if ip.version == 6 else str(ip)
    return [own, *(["localhost"] if ip.is_loopback else []), *(n.lower() for n in names)]


# What a Host header names (a port aside): a DNS name, an IPv4 address, or an IPv6 one in
# brackets. No wildcard: a name the console answers is one its operator chose.
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def _token(args: argparse.Namespace, host: str) -> str | None:
    """The token to ask for; ``None`` only for ``--no-token`` on loopback."""
    loopback = _loopback(host)
    if not loopback and not args.allow_remote:
        raise UsageError(
            f"{host} is not a loopback address: pass --allow-remote to listen there "
            "(behind TLS: the token travels in a cookie)"
        )
    if args.no_token:
        if not loopback:
            raise UsageError("--no-token is for a loopback address only")
        return None
    return str(args.token) if args.token else secrets.token_urlsafe(24)


def _anyone(read_only: bool) -> Callable[[Any, str], str | None]:
    """Everyone who reaches the loopback address: ``--no-token``."""

    def authorize(request: Any, action: str) -> str | None:
        return "local" if not read_only or action == "view" else None

    return authorize


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
