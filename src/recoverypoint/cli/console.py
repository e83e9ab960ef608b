"""``recoverypoint console``: the web console on its own, for a laptop or a bastion.

It binds to loopback and asks each browser for a token it prints at start (or one given
with ``--token`` or ``$RECOVERYPOINT_CONSOLE_TOKEN``). Another address needs
``--allow-remote``, and then a token always: ``--no-token`` is for loopback only.
Token holders are operators, or viewers with ``--read-only``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

from ..exits import EXIT_OK, EXIT_USAGE, fail
from ._app import UsageError
from ._common import Subparsers, add_database_options, add_stuck_after, address, admin_for

DEFAULT_BIND = "127.0.0.1:8080"
TOKEN_ENV = "RECOVERYPOINT_CONSOLE_TOKEN"


def add_console(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "console",
        help="serve the web console of keys and staged jobs",
        description=__doc__.splitlines()[0].strip("`"),
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
    add_database_options(parser, json=False)
    add_stuck_after(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..console import TokenLock, console
    except ImportError:
        return fail("console", EXIT_USAGE, "missing: pip install 'recoverypoint[console]'")
    try:
        host, port = address(args.bind, DEFAULT_BIND)
        token = _token(args, host)
        with admin_for(args) as ops:
            app: Any  # an ASGI app: the console, or the console behind its lock
            if token is None:
                app = console(ops, authorize=_anyone(args.read_only))
            else:
                lock = TokenLock(token, read_only=args.read_only)
                app = lock.guard(console(ops, authorize=lock.authorize))
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
