from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch import ascode


class Command(BaseCommand):
    help = (
        "Apply definition files (docs/as-code.md): validate everything, print the changes "
        "(secrets masked), then write them in one transaction."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("files", nargs="+", metavar="FILE", help="YAML definition files")
        parser.add_argument(
            "--dry-run", action="store_true", help="print the changes, write nothing"
        )
        parser.add_argument(
            "--prune",
            action="store_true",
            help="delete objects an earlier apply created that the files no longer define "
            "(never one with live runs)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            plan = ascode.plan(ascode.load_files(options["files"]), prune=options["prune"])
        except ascode.DefinitionError as exc:
            for problem in exc.problems:
                self.stderr.write(str(problem))
            raise CommandError(
                f"{len(exc.problems)} problem(s) in the definitions; nothing was written."
            ) from None
        self.stdout.write(plan.render())
        if options["dry_run"]:
            self.stdout.write("Dry run: nothing was written.")
            return
        try:
            result = ascode.apply(plan)
        except ascode.Conflict as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(result.summary())
