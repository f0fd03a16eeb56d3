from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatch.ops import alerts, binding_metrics, retention


class Command(BaseCommand):
    help = (
        "One retention pass: delete finished runs past their status's retention (never "
        "live runs, nor the latest run of a binding or schedule), stopped workers and old "
        "alerts, in small batches."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
        )
        parser.add_argument(
            "--batch",
            type=int,
            default=None,
            help="runs per transaction (DISPATCH_RETENTION_BATCH)",
        )
        parser.add_argument(
            "--max-batches",
            type=int,
            default=None,
            help="batches in this pass at most (DISPATCH_RETENTION_MAX_BATCHES)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("batch", "max_batches"):
            if options[name] is not None and options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1.")
        if not options["dry_run"]:
            # Retention waits for the health scan and the metrics fold to read a run
            # (rule R5): bring them up to date first, so a site whose workers run without
            # maintenance and prunes from cron still prunes (their alerts wait PENDING
            # for a drain).
            scanned = alerts.scan().runs
            folded = binding_metrics.fold()
            self.stdout.write(f"health scan: {scanned} run(s) read; metrics fold: {folded}")
        report = retention.prune(
            dry_run=options["dry_run"], batch=options["batch"], max_batches=options["max_batches"]
        )
        self.stdout.write(report.summary())
