from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from dispatch.worker import claims


class Command(BaseCommand):
    help = "One recovery pass: settle every RUNNING attempt whose lease has expired."

    def handle(self, *args: Any, **options: Any) -> None:
        settled = claims.recover()
        blocked = claims.refresh_blocked()
        for r in settled:
            self.stdout.write(f"run {r.run_id} attempt {r.number}: {r.outcome}")
        self.stdout.write(
            f"settled {len(settled)} expired attempt(s); {blocked} blocked reason(s) updated"
        )
