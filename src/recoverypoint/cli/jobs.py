"""``recoverypoint jobs list|show|retry|delete``: staged jobs the enqueuer has not published."""

from __future__ import annotations

import argparse

from .. import admin
from ..exits import EXIT_OK
from ._app import UsageError
from ._common import Subparsers, add_database_options, admin_for, guarded, record_id, row_limit
from ._output import print_fields, print_json, print_table, seconds, truncate


def add_jobs(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "jobs",
        help="staged jobs waiting for the enqueuer",
        description=(
            "Staged jobs are deleted as soon as the enqueuer publishes them, so these are the "
            "ones waiting or failing. A job being published right now is left alone. Exit "
            "status: 0 done, 1 failed, 2 usage, 3 not found, 4 refused."
        ),
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    listing = commands.add_parser("list", help="staged jobs, newest first")
    _add_filters(listing, most=50)
    add_database_options(listing)
    listing.set_defaults(handler=guarded("jobs list", _list))

    show = commands.add_parser("show", help="one staged job")
    show.add_argument("id", type=record_id)
    add_database_options(show)
    show.set_defaults(handler=guarded("jobs show", _show))

    for name, help, handler in (
        ("retry", "make jobs due now: the enqueuer publishes them on its next pass", _retry),
        ("delete", "delete staged jobs: they will never be published", _delete),
    ):
        action = commands.add_parser(name, help=help, description=help)
        action.add_argument("ids", type=record_id, nargs="*", metavar="ID")
        _add_filters(action, most=1000)
        action.add_argument("--yes", action="store_true", help="act on every job selected")
        action.add_argument("--dry-run", action="store_true", help="count and sample only")
        if name == "retry":
            action.add_argument("--reset-attempts", action="store_true")
        add_database_options(action)
        action.set_defaults(handler=guarded(f"jobs {name}", handler))


def _add_filters(parser: argparse.ArgumentParser, *, most: int) -> None:
    group = parser.add_argument_group("filters (all must match)")
    group.add_argument("--name", help="job name")
    group.add_argument("--key-id", type=record_id, metavar="ID", help="staged by this key record")
    group.add_argument("--failing", action="store_true", help="publish failed at least once")
    group.add_argument("--limit", type=row_limit, default=most, metavar="N")


def _filter(args: argparse.Namespace) -> admin.JobFilter:
    return admin.JobFilter(
        ids=tuple(getattr(args, "ids", ())),
        name=args.name,
        key_id=args.key_id,
        failing=args.failing,
        limit=args.limit,
    )


_HEADERS = ("id", "job", "key id", "job key", "attempts", "next attempt", "age", "last error")


def _cells(job: admin.Job) -> list[object]:
    return [
        job.id,
        job.job_name,
        job.idempotency_key_id,
        truncate(job.job_key, 24),
        job.attempts,
        job.next_attempt_at,
        seconds(job.age),
        truncate(job.last_error),
    ]


def _list(args: argparse.Namespace) -> int:
    with admin_for(args) as ops:
        jobs = admin.list_jobs(ops, _filter(args))
    if args.json:
        print_json(jobs)
    else:
        print_table(_HEADERS, [_cells(job) for job in jobs])
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    with admin_for(args) as ops:
        job = admin.find_job(ops, args.id)
    if args.json:
        print_json(job)
    else:
        print_fields([(name, value) for name, value in vars(job).items()])
    return EXIT_OK


def _target(args: argparse.Namespace) -> int | admin.JobFilter:
    selection = _filter(args)
    if len(args.ids) == 1 and not (args.name or args.key_id is not None or args.failing):
        return int(args.ids[0])
    if args.ids:
        return selection
    if selection.is_empty():
        raise UsageError("name jobs by ID, or select them with filters (e.g. --failing)")
    if not (args.yes or args.dry_run):
        raise UsageError("this acts on every job selected: see them with --dry-run, then --yes")
    return selection


def _retry(args: argparse.Namespace) -> int:
    target = _target(args)
    with admin_for(args) as ops:
        result = admin.retry_jobs(
            ops, target, reset_attempts=args.reset_attempts, dry_run=args.dry_run
        )
    return _report(args, result, "retried")


def _delete(args: argparse.Namespace) -> int:
    target = _target(args)
    with admin_for(args) as ops:
        result = admin.delete_jobs(ops, target, dry_run=args.dry_run)
    return _report(args, result, "deleted")


def _report(args: argparse.Namespace, result: admin.JobActionResult, done: str) -> int:
    if args.json:
        print_json({**vars(result), "skipped": result.skipped})
        return EXIT_OK
    if result.dry_run:
        verb = result.action.split(".")[1]
        print(f"dry run: would {verb} {len(result.matched)} jobs; nothing changed")
        print_table(_HEADERS, [_cells(job) for job in result.sample])
        return EXIT_OK
    print(f"{done} {len(result.changed)} of {len(result.matched)} jobs")
    if result.skipped:
        print(f"left alone, being published: {', '.join(map(str, result.skipped))}")
    return EXIT_OK
