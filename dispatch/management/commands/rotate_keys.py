from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from dispatch.ops.keys import rotate_all


class Command(BaseCommand):
    help = (
        "Re-encrypt datasource configs, binding hash keys and live attempt snapshots under "
        "the newest key."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        result = rotate_all()
        self.stdout.write(
            f"re-encrypted {result.datasources} datasource config(s), {result.bindings} "
            f"binding hash key(s) and {result.snapshots} live snapshot(s) under the newest key"
        )
