from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch.verify import invariants


class Command(BaseCommand):
    help = (
        "Check the dispatch invariants (no run lost, duplicated or stuck; fences and sink "
        "rows; schedule slots). Exit 1 with a report on any violation."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--run-ids",
            metavar="FILE",
            help="a file of run ids, one a line, that must all exist and be terminal",
        )
        parser.add_argument("--requested-by", help="check the runs with this requested_by")
        parser.add_argument(
            "--schedule", action="append", default=[], metavar="ID", help="a schedule id"
        )
        parser.add_argument("--no-sinks", action="store_true", help="skip the sink databases")
        parser.add_argument(
            "--receipts",
            action="store_true",
            help="recompute every delivery's receipt on its sink and record the result on "
            "its attempt",
        )
        parser.add_argument(
            "--history",
            action="append",
            default=[],
            metavar="SOURCE=HISTORY",
            help="an incremental binding's source table and the relation (in the source "
            "database) holding its every version, e.g. public.events=public.events_history",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        run_ids: frozenset[Any] = frozenset()
        if options["run_ids"]:
            path = Path(options["run_ids"])
            try:
                run_ids = invariants.parse_run_ids(path.read_text().splitlines())
            except OSError as exc:
                raise CommandError(f"cannot read --run-ids {path}: {exc.strerror}") from None
            except ValueError as exc:
                raise CommandError(f"--run-ids {path}: {exc}") from None
        try:
            schedules = invariants.parse_run_ids(options["schedule"])
        except ValueError as exc:
            raise CommandError(f"--schedule: {str(exc).replace('run id', 'schedule id')}") from None
        scope = invariants.Scope(
            run_ids=run_ids, requested_by=options["requested_by"], schedule_ids=schedules
        )
        history = {}
        for item in options["history"]:
            source, sep, relation = item.partition("=")
            if not sep or not source.strip() or not relation.strip():
                raise CommandError(f"--history {item!r}: expected SOURCE=HISTORY, two table names")
            history[source.strip()] = relation.strip()
        if options["receipts"] and options["no_sinks"]:
            raise CommandError("--receipts reads the sinks: it cannot go with --no-sinks")
        report = invariants.check(
            scope, sinks=not options["no_sinks"], history=history, receipts=options["receipts"]
        )
        self.stdout.write(report.render())
        if not report.ok:
            sys.exit(1)
