from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Another app's runworker (as Django Channels has one)."

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write("the other app's runworker")
