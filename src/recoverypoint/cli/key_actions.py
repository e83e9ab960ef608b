"""``recoverypoint keys retry|release|abandon|reopen|delete|purge|reconcile``.

One key by ID; several by IDs; or every key some filters select, which needs ``--yes``
(``--dry-run`` prints how many and a sample instead). The fencing is the library's
(:mod:`recoverypoint.admin.key_actions`): whatever changed since a key was read is left
alone, and a single key that changed is refused (exit 4).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import timedelta

from .. import admin
from ..exits import EXIT_OK
from ._app import UsageError
from ._common import Subparsers, admin_for, confirm, duration, guarded, http_status, record_id
from ._output import print_json, print_table
from ._selection import KEY_HEADERS, add_common, add_filters, key_cells, key_filter

Target = int | admin.KeyFilter


def add_key_actions(commands: Subparsers) -> None:
    def action(
        name: str, help: str, handler: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help, description=help)
        parser.add_argument("ids", type=record_id, nargs="*", metavar="ID", help="key record ids")
        add_filters(parser, most=1000)
        parser.add_argument(
            "--yes", action="store_true", help="act on every key the filters select"
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="print how many keys and a sample; change nothing",
        )
        add_common(parser, reveal=False)
        parser.set_defaults(handler=guarded(f"keys {name}", handler), reveal=False)
        return parser

    retry = action("retry", "make unfinished keys due now, for the completer or a client", _retry)
    retry.add_argument(
        "--reset-attempts", action="store_true", help="count attempts from zero again"
    )
    release = action(
        "release",
        "clear expired leases (a live one needs --force: its holder then fails with LockLost)",
        _release,
    )
    release.add_argument("--force", action="store_true", help="clear live leases too")
    abandon = action(
        "abandon", "finish unfinished keys with a stored error response retries replay", _abandon
    )
    abandon.add_argument(
        "--response-status",
        type=http_status,
        default=admin.DEFAULT_ABANDON_STATUS,
        metavar="CODE",
        help="the status retries get replayed (default 500)",
    )
    abandon.add_argument(
        "--message", default=admin.DEFAULT_ABANDON_MESSAGE, help="what a retrying client is told"
    )
    abandon.add_argument("--force", action="store_true", help="even under a live lease")
    reopen = action(
        "reopen", "make abandoned keys unfinished again, due now (asks to confirm)", _reopen
    )
    reopen.add_argument(
        "--keep-attempts", action="store_true", help="do not count attempts from zero again"
    )
    delete = action("delete", "delete finished keys (unfinished ones need --force)", _delete)
    delete.add_argument("--force", action="store_true", help="unfinished keys too")

    reconcile = commands.add_parser(
        "reconcile",
        help="resolve a key that needs reconciliation: its step's result, or call it anew",
        description="A key needs reconciliation when its next foreign step is past its "
        "provider's dedupe window and declares no reconcile hook. Ask the provider what the "
        "step's last call did (its downstream key: `keys show ID`), then record its result "
        "with --found JSON (what the step returns), or pass --not-found to have the step "
        "called anew with a fresh downstream key. The key is then due now.",
    )
    reconcile.add_argument("id", type=record_id, metavar="ID", help="the key record's id")
    found = reconcile.add_mutually_exclusive_group(required=True)
    found.add_argument("--found", type=_json_object, metavar="JSON", help="the step's result")
    found.add_argument("--not-found", action="store_true", help="call the step anew")
    reconcile.add_argument("--dry-run", action="store_true", help="check it; change nothing")
    add_common(reconcile, reveal=False)
    reconcile.set_defaults(handler=guarded("keys reconcile", _reconcile), reveal=False)

    purge = commands.add_parser(
        "purge",
        help="delete keys finished before a time, as the reaper does",
        description="Delete keys finished more than --older-than ago; abandoned ones only "
        "with --abandoned. Needs --yes (or --dry-run).",
    )
    purge.add_argument("--older-than", type=duration, required=True, metavar="DURATION")
    purge.add_argument("--abandoned", action="store_true", help="abandoned keys too")
    purge.add_argument("--yes", action="store_true")
    purge.add_argument("--dry-run", action="store_true")
    add_common(purge, reveal=False)
    purge.set_defaults(handler=guarded("keys purge", _purge))


def _target(args: argparse.Namespace) -> Target:
    selection = key_filter(args, tuple(args.ids))
    if len(args.ids) == 1 and selection.criteria().keys() == {"ids"}:
        return int(args.ids[0])
    if args.ids:
        return selection  # named one by one: no --yes needed
    if selection.is_empty():
        raise UsageError("name keys by ID, or select them with filters (e.g. --state stuck)")
    if not (args.yes or args.dry_run):
        raise UsageError(
            "this acts on every key the filters select (up to --limit): see them with "
            "--dry-run, then pass --yes"
        )
    return selection


def _retry(args: argparse.Namespace) -> int:
    target = _target(args)
    with admin_for(args) as ops:
        result = admin.retry(ops, target, reset_attempts=args.reset_attempts, dry_run=args.dry_run)
    return _report(args, result, isinstance(target, int), "retried", "next attempt now")


def _release(args: argparse.Namespace) -> int:
    target = _target(args)
    with admin_for(args) as ops:
        result = admin.release(ops, target, force=args.force, dry_run=args.dry_run)
    return _report(
        args,
        result,
        isinstance(target, int),
        "released",
        "the lease is free; a retry may take the key",
    )


def _abandon(args: argparse.Namespace) -> int:
    target = _target(args)
    with admin_for(args) as ops:
        result = admin.abandon(
            ops, target, status=args.response_status, message=args.message, force=args.force,
            dry_run=args.dry_run,
        )  # fmt: skip
    return _report(
        args,
        result,
        isinstance(target, int),
        "abandoned",
        f"retries now replay a {args.response_status}. {admin.ABANDON_EFFECTS}",
    )


def _reopen(args: argparse.Namespace) -> int:
    target = _target(args)
    if not args.dry_run:
        what = f"key {target}" if isinstance(target, int) else "the selected abandoned keys"
        confirm(
            f"Reopen {what}? Its stored error response is dropped, and the next retry or "
            "completer pass runs it on from its recovery point.",
            args.yes,
        )
    with admin_for(args) as ops:
        result = admin.reopen(
            ops, target, reset_attempts=not args.keep_attempts, dry_run=args.dry_run
        )
    return _report(args, result, isinstance(target, int), "reopened", "unfinished again, due now")


def _delete(args: argparse.Namespace) -> int:
    target = _target(args)
    with admin_for(args) as ops:
        result = admin.delete(ops, target, force=args.force, dry_run=args.dry_run)
    return _report(
        args, result, isinstance(target, int), "deleted", "gone; its staged jobs stay, unlinked"
    )


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): pass the step's result") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            'pass the step\'s result as a JSON object, such as \'{"charge_id": "ch_1"}\''
        )
    return value


def _reconcile(args: argparse.Namespace) -> int:
    with admin_for(args) as ops:
        result = admin.reconcile(ops, args.id, found=args.found, dry_run=args.dry_run)
    effect = (
        "its step's result is recorded; it runs on"
        if args.found is not None
        else "its step is called anew, with a fresh downstream key"
    )
    return _report(args, result, True, "reconciled", f"{effect}, due now")


def _purge(args: argparse.Namespace) -> int:
    if not (args.yes or args.dry_run):
        raise UsageError("purge deletes every key it selects: see them with --dry-run, then --yes")
    with admin_for(args) as ops:
        result = admin.purge(
            ops,
            timedelta(seconds=args.older_than),
            include_abandoned=args.abandoned,
            dry_run=args.dry_run,
        )
    return _report(args, result, False, "purged", "deleted")


def _report(
    args: argparse.Namespace, result: admin.ActionResult, single: bool, done: str, effect: str
) -> int:
    if args.json:
        print_json({**_fields(result), "skipped": result.skipped})
        return EXIT_OK
    verb = result.action.split(".")[1]
    if result.dry_run:
        would = result.matched if result.action == "keys.purge" else len(result.eligible)
        print(f"dry run: would {verb} {would} of {result.matched} selected keys; nothing changed")
        if result.sample:
            print_table(KEY_HEADERS, [key_cells(row) for row in result.sample])
        return EXIT_OK
    if single:
        print(f"{done} key {result.changed[0]}: {effect}")
        return EXIT_OK
    ids = ", ".join(map(str, result.changed[:20])) + ("…" if len(result.changed) > 20 else "")
    print(
        f"{done} {len(result.changed)} of {result.matched} selected keys{': ' + ids if ids else ''}"
    )
    if result.skipped:
        print(f"left alone, changed since they were read: {', '.join(map(str, result.skipped))}")
    ignored = result.matched - len(result.eligible)
    if ignored and result.action != "keys.purge":
        print(f"{ignored} selected keys were not in a state to be {done}")
    return EXIT_OK


def _fields(result: admin.ActionResult) -> dict[str, object]:
    return {
        "action": result.action,
        "matched": result.matched,
        "eligible": result.eligible,
        "changed": result.changed,
        "dry_run": result.dry_run,
        "sample": result.sample,
    }
