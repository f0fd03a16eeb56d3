"""Bulk operations: one operator action applied to every row that matches a console filter
(docs/console.md, "Bulk operations"; docs/architecture.md, "Bulk operations").

The console stores the request; the maintenance loop of any worker works it through in
keyset batches (`dispatch.ops.bulk`). Nothing in the claim path reads or writes them.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class BulkStatus(models.TextChoices):
    # In: the console's request. Out: the maintenance loop when the last batch is done
    # (-> DONE) or the requester may no longer apply the action (-> REFUSED); an
    # operator's cancel (-> CANCELLED).
    PENDING = "PENDING", "In progress"
    # In: the maintenance loop, after the batch that found no more matching rows. Final.
    DONE = "DONE", "Done"
    # In: an operator's cancel, between two batches (a batch in flight commits first). Final.
    CANCELLED = "CANCELLED", "Cancelled"
    # In: the maintenance loop, when the requester lacks the action's permission (or is
    # gone or inactive) at run time; nothing of the next batch is applied. Final.
    REFUSED = "REFUSED", "Refused"


class BulkOperation(models.Model):
    """One "apply to all matching": the model, the validated filter (the changelist's
    query parameters), the action, who asked and how many rows matched then, and the
    keyset cursor (the last primary key handled) with the counts, both written in the
    transaction of the batch they describe."""

    id = models.BigAutoField(primary_key=True)
    model = models.CharField(max_length=40)  # "run" or "jobbinding"
    action = models.CharField(max_length=40)  # a key of dispatch.ops.bulk.ACTIONS
    filters = models.JSONField(default=dict, blank=True)  # {parameter: value}
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    requested_by_name = models.CharField(max_length=150, blank=True, default="")
    status = models.CharField(max_length=20, choices=BulkStatus.choices, default=BulkStatus.PENDING)
    total = models.PositiveIntegerField(default=0)  # rows matching at request time
    done = models.PositiveIntegerField(default=0)  # rows the action applied to
    skipped = models.PositiveIntegerField(default=0)  # rows refused (a BulkSkip each)
    batches = models.PositiveIntegerField(default=0)
    # The keyset cursor: the greatest primary key handled (both models' keys are UUIDs).
    cursor = models.UUIDField(null=True, blank=True)
    error = models.TextField(blank=True, default="")  # why REFUSED
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)
    cancelled_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "bulk operation"
        permissions = [("cancel_bulkoperation", "Can cancel a bulk operation")]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=BulkStatus.values), name="dispatch_bulk_status_valid"
            ),
        ]
        indexes = [
            # The maintenance loop's pick: the oldest PENDING operation not locked.
            models.Index(
                fields=["id"],
                condition=Q(status=BulkStatus.PENDING),
                name="dispatch_bulk_pending_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"bulk operation {self.pk}: {self.action} {self.model}"

    @property
    def finished(self) -> bool:
        return self.status != BulkStatus.PENDING


class BulkSkip(models.Model):
    """A row a bulk operation did not apply its action to, and why (the refusal's code
    and message, as the one-at-a-time action reports it)."""

    id = models.BigAutoField(primary_key=True)
    # No index of its own: dispatch_bulkskip_op_idx (operation, id) leads with it.
    operation = models.ForeignKey(
        BulkOperation, on_delete=models.CASCADE, related_name="skips", db_index=False
    )
    object_id = models.UUIDField()
    object_repr = models.CharField(max_length=300)
    code = models.CharField(max_length=40)
    message = models.TextField()

    class Meta:
        ordering = ["id"]
        verbose_name = "bulk operation skip"
        indexes = [
            # An operation's page: its skipped rows in the order they were met.
            models.Index(fields=["operation", "id"], name="dispatch_bulkskip_op_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.object_repr}: {self.code}"
