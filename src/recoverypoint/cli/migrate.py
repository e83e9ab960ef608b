"""``recoverypoint migrate``: create or upgrade recoverypoint's tables, or print the SQL."""

from __future__ import annotations

import argparse
import os
import sys

from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from .. import distribute, migrate
from ..database import DATABASE_URL_ENV, create_engine, normalize_url
from ..errors import ConfigurationError
from ..exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail
from ._common import Subparsers


def add_migrate(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="create or upgrade recoverypoint's tables",
        description=(
            "Bring recoverypoint's tables to the newest schema; a database already there is "
            "left alone. The version is kept in recoverypoint_alembic_version, apart from "
            "your own Alembic history."
        ),
    )
    parser.add_argument(
        "--database-url",
        metavar="URL",
        default=os.environ.get(DATABASE_URL_ENV),
        help=f"postgresql://user:password@host:port/database (default: ${DATABASE_URL_ENV})",
    )
    parser.add_argument(
        "--sql",
        action="store_true",
        help="print the SQL instead of running it; no database is contacted",
    )
    parser.add_argument(
        "--citus",
        action="store_true",
        help=(
            "on a Citus coordinator, then distribute recoverypoint's tables by scope "
            "(README: Scaling out on Citus)"
        ),
    )
    parser.add_argument(
        "--colocate",
        metavar="TABLE[:COLUMN]",
        action="append",
        default=[],
        help=(
            "with --citus: one of your tables to distribute by its scope column (default "
            "'scope') and co-locate with recoverypoint's; repeat for more"
        ),
    )
    parser.set_defaults(handler=_migrate)


def _migrate(args: argparse.Namespace) -> int:
    from alembic.util import CommandError  # Alembic: imported only by the command migrating

    if args.colocate and not args.citus:
        return fail("migrate", EXIT_USAGE, "--colocate distributes tables: add --citus")
    try:
        distribution = distribute.statements(args.colocate)
    except ValueError as exc:
        return fail("migrate", EXIT_USAGE, str(exc))
    if args.sql:
        migrate.upgrade_sql(sys.stdout)
        if args.citus:
            print("-- Citus: distribute by scope (run on the coordinator)")
            print("\n".join(distribution))
        return EXIT_OK
    if not args.database_url:
        return fail(
            "migrate",
            EXIT_USAGE,
            f"no database to migrate: pass --database-url postgresql://user:password@host/db "
            f"or set {DATABASE_URL_ENV} (or use --sql to print the SQL instead)",
        )
    try:
        url = normalize_url(args.database_url)
    except ValueError as exc:
        return fail("migrate", EXIT_USAGE, str(exc))
    if args.citus:  # before anything is written: a server without Citus is left alone
        try:
            _on_citus(url)
        except ConfigurationError as exc:
            return fail("migrate", EXIT_FAILED, str(exc))
        except DBAPIError as exc:
            detail = " ".join(str(exc.orig or exc).split())
            return fail(
                "migrate", EXIT_FAILED, f"{url.render_as_string(hide_password=True)}: {detail}"
            )
    try:
        result = migrate.upgrade(url)
    except DBAPIError as exc:
        # The driver's message says what went wrong (refused, no such database, bad
        # password); a traceback would only bury it. Its lines are joined into one.
        detail = " ".join(str(exc.orig or exc).split())
        return fail("migrate", EXIT_FAILED, f"{url.render_as_string(hide_password=True)}: {detail}")
    except CommandError as exc:  # e.g. the database is at a revision this version lacks
        return fail("migrate", EXIT_FAILED, str(exc))
    if result.applied:
        print(f"applied {', '.join(result.applied)}; ", end="")
    print(f"recoverypoint schema is at revision {result.revision} (head)")
    if args.citus:
        db = create_engine(url, poolclass=NullPool)
        try:
            placed = distribute.distribute(db, args.colocate)
        except ConfigurationError as exc:
            return fail("migrate", EXIT_FAILED, str(exc))
        except DBAPIError as exc:  # Citus refused a table (its key lacks the column, ...)
            return fail("migrate", EXIT_FAILED, " ".join(str(exc.orig or exc).split()))
        finally:
            db.dispose()
        print(f"distributed by scope: {', '.join(placed) if placed else 'nothing new'}")
    return EXIT_OK


def _on_citus(url: URL) -> None:
    db = create_engine(url, poolclass=NullPool)
    try:
        distribute.require_citus(db)
    finally:
        db.dispose()
