"""``recoverypoint demo``: the Rocket Rides example under crashes and faults, checked.

:mod:`.harness` runs it (``run(DemoConfig(...), database_url, workdir)`` returns a
:class:`~.report.Report`), :mod:`.faults` says which faults fire, :mod:`.load` drives the
clients, :mod:`.checks` holds the invariants, :mod:`.cli` is the command. The tests run the
same harness at several fault mixes.
"""
