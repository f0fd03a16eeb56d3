from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from dispatch import ascode


class Command(BaseCommand):
    help = (
        "Print the datasources, jobs, bindings and schedules as a definition file "
        "(docs/as-code.md) that applies back to the same state; secrets as references."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--managed-only",
            action="store_true",
            help="only the objects definition files manage (those an apply wrote)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        result = ascode.export(managed_only=options["managed_only"])
        self.stdout.write(result.text, ending="")
        for note in result.notes:
            self.stderr.write(f"note: {note}")
