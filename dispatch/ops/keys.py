"""Key rotation: re-encrypt every ciphertext under the newest key, without downtime.

Each datasource row (and each binding's hash key) is locked while its ciphertext is rotated (FOR UPDATE: a concurrent
claim's FOR SHARE waits a moment); attempt snapshots are rotated with a guarded update
that only touches a snapshot still equal to what was read, so one that its attempt's
settlement erased meanwhile stays erased.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from dispatch.models import Attempt, Datasource, JobBinding
from dispatch.security import crypto


@dataclass
class RotationResult:
    datasources: int = 0
    snapshots: int = 0
    bindings: int = 0


def rotate_all() -> RotationResult:
    result = RotationResult()
    for pk in Datasource.objects.values_list("pk", flat=True):
        with transaction.atomic():
            row = (
                Datasource.objects.select_for_update()
                .filter(pk=pk)
                .values_list("config_ciphertext", flat=True)
                .first()
            )
            if not row:
                continue
            Datasource.objects.filter(pk=pk).update(config_ciphertext=crypto.rotate(row))
            result.datasources += 1
    for pk in JobBinding.objects.exclude(hash_key_ciphertext="").values_list("pk", flat=True):
        with transaction.atomic():
            key = (
                JobBinding.objects.select_for_update()
                .filter(pk=pk)
                .values_list("hash_key_ciphertext", flat=True)
                .first()
            )
            if not key:
                continue
            JobBinding.objects.filter(pk=pk).update(hash_key_ciphertext=crypto.rotate(key))
            result.bindings += 1
    for attempt_id, source, sink in Attempt.objects.filter(
        source_snapshot__isnull=False
    ).values_list("pk", "source_snapshot", "sink_snapshot"):
        if source is None:
            continue
        updated = Attempt.objects.filter(
            pk=attempt_id, source_snapshot=source, sink_snapshot=sink
        ).update(
            source_snapshot=crypto.rotate(source),
            sink_snapshot=crypto.rotate(sink) if sink else None,
        )
        result.snapshots += updated
    return result
