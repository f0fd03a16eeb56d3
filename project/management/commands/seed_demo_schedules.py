from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from dispatch.models import JobBinding
from scheduling.models import Schedule

DEMO_BINDING = "demo-generate-to-null"
DEMO_CRON = "* * * * *"


class Command(BaseCommand):
    help = "Add an enabled every-minute schedule to the demo binding (after seed_demo); idempotent."

    def handle(self, *args: Any, **options: Any) -> None:
        binding = JobBinding.objects.filter(name=DEMO_BINDING).first()
        if binding is None:
            raise CommandError(f"binding {DEMO_BINDING!r} does not exist; run seed_demo first.")
        schedule = Schedule.objects.filter(binding=binding, cron=DEMO_CRON).first()
        if schedule is None:
            schedule = Schedule.objects.create(binding=binding, cron=DEMO_CRON, timezone="UTC")
            self.stdout.write(
                f"  Schedule: {schedule} (every minute), next at {schedule.next_fire_at:%H:%M} UTC"
            )
        else:
            self.stdout.write(f"  Schedule: {schedule} (every minute, already there)")
