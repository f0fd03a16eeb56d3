from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from scheduling.reconciler import ScheduleReconciler


class Command(BaseCommand):
    help = "Register schedules and fire every due slot once; --loop keeps doing so until SIGTERM/SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--loop", action="store_true", help="keep reconciling until SIGTERM/SIGINT"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        reconciler = ScheduleReconciler()
        if options["loop"]:
            stop = threading.Event()

            def handler(signum: int, frame: FrameType | None) -> None:
                stop.set()

            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)
            reconciler.run(stop)
            return
        report = reconciler.run_once()
        for fired in report.fired:
            kind = "catch-up run" if fired.catch_up else "run"
            self.stdout.write(
                f"schedule {fired.schedule_id} slot {fired.slot.isoformat()}: "
                f"{kind} {fired.run_id}" + (" (existing)" if fired.existing else "")
            )
        for skipped in report.skipped:
            self.stdout.write(
                f"schedule {skipped.schedule_id} slot {skipped.slot.isoformat()}: "
                f"skipped ({skipped.reason})"
            )
        for schedule_id in report.failed:
            self.stderr.write(f"schedule {schedule_id}: cannot be evaluated (see the log)")
        self.stdout.write(str(report))
