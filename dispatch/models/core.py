"""Datasources, jobs, bindings, runs, attempts and workers (contract section 2).

Reads go through QuerySet methods; every write a worker makes after its claim goes
through the guarded SQL functions in `dispatch/sql/` (never a bare `save()`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.db.models import Q
from django.db.models.functions import Now

from dispatch.core.states import (
    LIVE_STATUSES,
    TERMINAL_RUN_STATUSES,
    BlockedReason,
    ChainOn,
    Origin,
    Reason,
    Status,
    Trigger,
)
from dispatch.security import crypto, jsondepth, limits, names
from dispatch.security.jsondepth import BoundedJSONField

_LIVE = Q(status__in=[Status.PENDING, Status.RUNNING])


# Written only together, by a config change (see Datasource.save).
_CONFIG_COLUMNS = frozenset({"config_ciphertext", "version", "redacted_config"})

# Who defines a datasource, job, binding or schedule: the console ("") or definition files
# applied with `dispatch_apply` (dispatch.ascode). The next apply overwrites a console edit
# of an object the files manage, and `--prune` may delete one the files no longer name.
MANAGED_BY_FILES = "files"
MANAGED_BY_CHOICES = [("", "console"), (MANAGED_BY_FILES, "files")]


def managed_by_field() -> models.CharField:  # type: ignore[type-arg]
    """The `managed_by` column of every model definition files may hold."""
    return models.CharField(
        max_length=20,
        choices=MANAGED_BY_CHOICES,
        blank=True,
        default="",
        db_default="",
        editable=False,
        help_text="files: defined by definition files (dispatch_apply); their next apply "
        "overwrites edits made here.",
    )


class DatasourceQuerySet(models.QuerySet["Datasource"]):
    def enabled(self) -> DatasourceQuerySet:
        return self.filter(enabled=True)


class Datasource(models.Model):
    """Connection settings of one datasource; `config` is a dict stored encrypted.

    `version` is bumped on every config change; the ciphertext's envelope names the id
    and version, so it cannot be moved to another row unnoticed.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True, validators=[names.validate_name])
    kind = models.CharField(max_length=50, help_text="The connector kind, e.g. postgresql.")
    config_ciphertext = models.TextField(editable=False)
    # Non-secret fields of the config, for display; secret fields are replaced by a mask.
    redacted_config = BoundedJSONField(default=dict, editable=False)
    enabled = models.BooleanField(default=True)
    version = models.PositiveIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)
    managed_by = managed_by_field()
    # Where definition files took each secret from ({"password": "env:NAME"}): references,
    # never values, so an export writes them back. A console edit of a secret drops its
    # reference (dispatch.console.forms).
    secret_refs = models.JSONField(default=dict, blank=True, editable=False, db_default={})

    objects = DatasourceQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        permissions = [("test_datasource", "Can test a datasource's connection")]
        constraints = [
            jsondepth.depth_check("redacted_config", "dispatch_datasource_redacted_depth"),
            names.name_check("dispatch_datasource"),
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.pop("config", None)
        super().__init__(*args, **kwargs)
        self._plain_config: dict[str, Any] | None = None
        self._config_dirty = False
        if config is not None:
            self.config = config

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        from dispatch.connectors import registry

        if not self._config_dirty:
            if not self._state.adding and "update_fields" not in kwargs:
                # Leave the ciphertext, its version and the redacted copy alone: this
                # instance may hold values older than a concurrent edit or key rotation.
                kwargs["update_fields"] = [
                    f.name
                    for f in self._meta.concrete_fields
                    if not f.primary_key and f.name not in _CONFIG_COLUMNS
                ]
            super().save(*args, **kwargs)
            return
        config = self._plain_config or {}
        try:
            connector = registry.get(self.kind)
            public = frozenset(f.name for f in connector.config_fields if not f.secret)
        except registry.UnknownKind:
            public = frozenset()
        self.redacted_config = redact(config, public)
        with transaction.atomic():
            if not self._state.adding:
                # Lock the row (an edit waits for a claim's FOR SHARE to end) and bump the
                # version from the stored value, so two edits never reuse a version.
                current = (
                    type(self)
                    .objects.select_for_update()
                    .values_list("version", flat=True)
                    .filter(pk=self.pk)
                    .first()
                )
                self.version = (current or 0) + 1
                self.updated_at = Now()  # type: ignore[assignment]
            self.config_ciphertext = crypto.encrypt_config(self.id, self.version, config)
            super().save(*args, **kwargs)
        self._config_dirty = False
        if not self._state.adding and isinstance(self.updated_at, Now):
            self.refresh_from_db(fields=["updated_at"])

    @property
    def config(self) -> dict[str, Any]:
        """The decrypted config (checked against this row's id and version)."""
        if self._plain_config is None:
            if not self.config_ciphertext:
                return {}
            self._plain_config = crypto.decrypt_config(
                self.config_ciphertext, expected_id=self.id, expected_version=self.version
            )
        return dict(self._plain_config)

    @config.setter
    def config(self, value: dict[str, Any]) -> None:
        if not isinstance(value, dict):
            raise TypeError("Datasource.config must be a dict")
        if self._plain_config is not None and value == self._plain_config:
            return
        self._plain_config = dict(value)
        self._config_dirty = True

    def clean(self) -> None:
        from dispatch.connectors import registry

        jsondepth.check("config", self.config)
        check_json_size("config", self.config)
        try:
            connector = registry.get(self.kind)
        except registry.UnknownKind as exc:
            raise ValidationError({"kind": str(exc)}) from None
        self._plain_config = connector.validate_config(self.config)

    def connector(self) -> Any:
        from dispatch.connectors import registry

        return registry.get(self.kind)


SECRET_MASK = "********"
# Configs and specs are settings, not data: anything larger is a mistake, and it would be
# copied into every attempt's snapshot.
MAX_JSON_BYTES = 64 * 1024


def check_json_size(field: str, value: Any) -> None:
    size = len(json.dumps(value, separators=(",", ":")).encode())
    if size > MAX_JSON_BYTES:
        raise ValidationError(
            {field: f"is {size:,} bytes of JSON; the limit is 64 KiB ({MAX_JSON_BYTES:,} bytes)"}
        )


_SECRET_WORDS = ("password", "passwd", "secret", "token", "key", "url", "dsn", "credential")


def redact(config: dict[str, Any], public_fields: frozenset[str] | set[str]) -> dict[str, Any]:
    """A copy safe to show: only fields the connector declares non-secret keep their
    value (and never one whose name suggests a secret); everything else is masked."""

    def shown(name: str) -> bool:
        return name in public_fields and not any(w in name.lower() for w in _SECRET_WORDS)

    return {k: (v if shown(k) or v in (None, "") else SECRET_MASK) for k, v in config.items()}


class Job(models.Model):
    """What to read and write, and how to retry."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True, validators=[names.validate_name])
    description = models.TextField(blank=True, default="")
    enabled = models.BooleanField(default=True)
    source_spec = BoundedJSONField(default=dict, blank=True)
    sink_spec = BoundedJSONField(default=dict, blank=True)
    max_attempts = models.PositiveIntegerField(
        default=3,
        validators=[MinValueValidator(1), MaxValueValidator(limits.MAX_ATTEMPTS)],
        help_text="Attempts in one retry budget (since the trigger or the last operator retry).",
    )
    backoff_seconds = models.FloatField(
        default=10.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(limits.MAX_BACKOFF_SECONDS)],
        help_text="Delay before the first automatic retry; doubles each retry. At most 7 days.",
    )
    backoff_max_seconds = models.FloatField(
        default=600.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(limits.MAX_BACKOFF_SECONDS)],
        help_text="The longest retry delay. At most 7 days.",
    )
    lease_seconds = models.PositiveIntegerField(
        default=30,
        validators=[MinValueValidator(2), MaxValueValidator(limits.MAX_LEASE_SECONDS)],
        help_text="A worker heartbeats every lease/3 seconds; recovery settles an attempt "
        "whose lease ran out.",
    )
    timeout_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(limits.MAX_TIMEOUT_SECONDS)],
        help_text="Bounds one execution (at most 7 days); empty for no bound.",
    )
    # A sliced source (source_spec `slices`): how many of a run's slices exist as runs at
    # once (queued or running); the rest wait as plan rows until one ends. Empty: all.
    max_slices_in_flight = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(limits.MAX_SLICES)],
        help_text="Slices of one sliced run queued or running at once (at least 1); empty "
        "for all of them. Each slice still counts in the binding's max_concurrency.",
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    managed_by = managed_by_field()

    class Meta:
        ordering = ["name"]
        permissions = [
            ("write_source_query", "Can write SQL queries that sources run (query specs)")
        ]
        constraints = [
            names.name_check("dispatch_job"),
            models.CheckConstraint(
                condition=Q(lease_seconds__gte=2), name="dispatch_job_lease_min"
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1), name="dispatch_job_attempts_min"
            ),
            models.CheckConstraint(
                condition=Q(backoff_seconds__gte=0) & Q(backoff_max_seconds__gte=0),
                name="dispatch_job_backoff_nonnegative",
            ),
            # Upper bounds (dispatch.security.limits): nothing past them reaches time arithmetic.
            models.CheckConstraint(
                condition=Q(backoff_seconds__lte=limits.MAX_BACKOFF_SECONDS)
                & Q(backoff_max_seconds__lte=limits.MAX_BACKOFF_SECONDS),
                name="dispatch_job_backoff_max",
            ),
            models.CheckConstraint(
                condition=Q(lease_seconds__lte=limits.MAX_LEASE_SECONDS),
                name="dispatch_job_lease_max",
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__lte=limits.MAX_ATTEMPTS),
                name="dispatch_job_attempts_max",
            ),
            models.CheckConstraint(
                condition=Q(timeout_seconds__isnull=True)
                | Q(timeout_seconds__gte=1, timeout_seconds__lte=limits.MAX_TIMEOUT_SECONDS),
                name="dispatch_job_timeout_range",
            ),
            models.CheckConstraint(
                condition=Q(max_slices_in_flight__isnull=True)
                | Q(max_slices_in_flight__gte=1, max_slices_in_flight__lte=limits.MAX_SLICES),
                name="dispatch_job_slices_in_flight_range",
            ),
            jsondepth.depth_check("source_spec", "dispatch_job_source_spec_depth"),
            jsondepth.depth_check("sink_spec", "dispatch_job_sink_spec_depth"),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        self.clean_values()
        if self.pk and not self._state.adding:
            for binding in self.bindings.select_related("source", "sink"):
                binding.validate_specs(job=self)

    def clean_values(self) -> None:
        """The job's own rules; `clean()` adds its stored bindings' spec checks (an apply
        of definition files checks the bindings it will leave instead)."""
        jsondepth.check("source_spec", self.source_spec)
        jsondepth.check("sink_spec", self.sink_spec)
        check_json_size("source_spec", self.source_spec)
        check_json_size("sink_spec", self.sink_spec)
        if self.backoff_max_seconds < self.backoff_seconds:
            raise ValidationError({"backoff_max_seconds": "must be at least backoff_seconds"})


class JobBindingQuerySet(models.QuerySet["JobBinding"]):
    def enabled(self) -> JobBindingQuerySet:
        return self.filter(enabled=True)


# The shortest hash key a binding takes (`JobBinding.set_hash_key`).
HASH_KEY_MIN_CHARS = 16


class JobBinding(models.Model):
    """A job attached to one source and one sink datasource."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True, validators=[names.validate_name])
    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="bindings")
    source = models.ForeignKey(Datasource, on_delete=models.PROTECT, related_name="source_bindings")
    sink = models.ForeignKey(Datasource, on_delete=models.PROTECT, related_name="sink_bindings")
    enabled = models.BooleanField(default=True)
    max_concurrency = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1)],
        help_text="Attempts of this binding that may run at once.",
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    managed_by = managed_by_field()
    # The key of the source's `columns.hash` (HMAC-SHA256), encrypted with the site's keys
    # (`crypto.encrypt_binding_secret`); empty: none. Written from the binding form, never
    # shown; the worker reads it after its claim, under its lease token.
    hash_key_ciphertext = models.TextField(blank=True, default="", db_default="", editable=False)

    objects = JobBindingQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        verbose_name = "binding"
        permissions = [
            ("trigger_binding", "Can trigger a run of a binding"),
            ("reset_cursor_binding", "Can reset a binding's incremental cursor"),
            ("set_cursor_binding", "Can set a binding's incremental cursor"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_concurrency__gte=1), name="dispatch_binding_concurrency_min"
            ),
            names.name_check("dispatch_jobbinding"),
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if self.job_id and self.source_id and self.sink_id:
            self.validate_specs()

    def set_hash_key(self, key: str | None) -> None:
        """Store (encrypted) the key of `columns.hash`, or forget it (None); saved with
        the binding. At least HASH_KEY_MIN_CHARS characters: a short key makes the
        pseudonyms of a known set of values (emails, names) easy to recompute."""
        from dispatch.security import crypto

        if key is None:
            self.hash_key_ciphertext = ""
            return
        if len(key) < HASH_KEY_MIN_CHARS:
            raise ValidationError({"hash_key": f"must be at least {HASH_KEY_MIN_CHARS} characters"})
        self.hash_key_ciphertext = crypto.encrypt_binding_secret(self.id, "hash_key", key)

    @property
    def has_hash_key(self) -> bool:
        return bool(self.hash_key_ciphertext)

    def validate_specs(self, job: Job | None = None) -> None:
        """Validate the job's specs against this binding's connector kinds (the same
        validator the worker applies again at claim: `connectors.base.spec_errors`)."""
        from dispatch.connectors import registry
        from dispatch.connectors.base import spec_errors

        job = job or self.job
        errors: dict[str, list[str]] = {}
        for role, datasource in (("source", self.source), ("sink", self.sink)):
            try:
                connector = registry.get(datasource.kind)
            except registry.UnknownKind as exc:
                errors[role] = [str(exc)]
                continue
            found = spec_errors(connector, role, getattr(job, f"{role}_spec"))
            if found:
                errors[role] = found
            elif (
                role == "sink"
                and isinstance(job.source_spec, dict)
                and job.source_spec.get("slices") is not None
                and not getattr(connector, "sliced_writes", False)
            ):
                errors[role] = [
                    f"a {datasource.kind} sink cannot take a sliced source (slices commit one "
                    "by one, each fenced by its own run): use a postgresql or null sink, or "
                    "drop slices from the source spec"
                ]
            elif role == "sink" and isinstance(job.source_spec, dict):
                refused = connector.sink_spec_errors_with_source(job.sink_spec, job.source_spec)
                if refused:
                    errors[role] = [f"sink_spec: {m}" for m in refused]
        if errors:
            raise ValidationError(errors)


class BindingEdge(models.Model):
    """A binding that waits for another: when a run of `upstream` ends as `on` asks, the
    settlement that ends it creates the run of `downstream` in the same transaction
    (dispatch_chain_fire, docs/architecture.md, "Chains"). A downstream with several
    upstreams runs once all of them, within one chain, have. Cycles are refused at save
    and by a table trigger."""

    id = models.BigAutoField(primary_key=True)
    # No index of its own: dispatch_bindingedge_uniq (upstream, downstream) leads with it.
    upstream = models.ForeignKey(
        JobBinding, on_delete=models.CASCADE, related_name="downstream_edges", db_index=False
    )
    downstream = models.ForeignKey(
        JobBinding, on_delete=models.CASCADE, related_name="upstream_edges", db_index=False
    )
    # "on" is a reserved word in SQL: the column is on_status.
    on = models.CharField(
        max_length=20, choices=ChainOn.choices, default=ChainOn.SUCCESS, db_column="on_status"
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        ordering = ["downstream", "upstream"]
        verbose_name = "binding edge"
        constraints = [
            models.UniqueConstraint(
                fields=["upstream", "downstream"], name="dispatch_bindingedge_uniq"
            ),
            models.CheckConstraint(
                condition=~Q(upstream=models.F("downstream")), name="dispatch_bindingedge_not_self"
            ),
            models.CheckConstraint(
                condition=Q(on__in=ChainOn.values), name="dispatch_bindingedge_on_valid"
            ),
        ]
        indexes = [
            # A fan-in's upstreams: the edges into one binding (dispatch_chain_fire).
            models.Index(fields=["downstream"], name="dispatch_bindingedge_down_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.upstream} -> {self.downstream} ({self.on})"


class RunQuerySet(models.QuerySet["Run"]):
    def live(self) -> RunQuerySet:
        return self.filter(status__in=LIVE_STATUSES)

    def terminal(self) -> RunQuerySet:
        return self.filter(status__in=TERMINAL_RUN_STATUSES)


# The run statuses a bulk operation acts on (dispatch_run_status_id_idx): every one but
# SUCCEEDED.
BULK_INDEXED_STATUSES = (
    Status.PENDING,
    Status.RUNNING,
    Status.WAITING,
    Status.FAILED,
    Status.CANCELLED,
)


class Run(models.Model):
    """One requested execution of a binding; its status is its latest attempt's.

    A sliced run (its job's source spec has `slices`) is planned by its first attempt and
    then WAITING: its slices are runs of their own (`parent` set, `slice_number` from 1),
    and its status is their combined state (`SlicePlan`, docs/architecture.md, "Slices").
    A slice run's id is a version-8 UUID, so a worker knows a slice from its claim."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own: dispatch_run_binding_idx (binding, created_at) leads with it,
    # and each index more is written by every claim and settlement.
    binding = models.ForeignKey(
        JobBinding, on_delete=models.PROTECT, related_name="runs", db_index=False
    )
    trigger = models.CharField(max_length=20, choices=Trigger.choices, default=Trigger.MANUAL)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    finished_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    # A plain UUID, not a foreign key: dispatch never depends on scheduling.
    schedule_id = models.UUIDField(null=True, blank=True)
    scheduled_for = models.DateTimeField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    requested_by = models.CharField(max_length=150, blank=True, default="")
    # A slice run: the sliced run it belongs to, and its number in that run's plan.
    # No index of its own: dispatch_run_slice_uniq (parent, slice_number) leads with it.
    parent = models.ForeignKey(
        "self",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="slice_runs",
        db_index=False,
        editable=False,
    )
    slice_number = models.PositiveIntegerField(null=True, blank=True, editable=False)
    # A run an upstream's settlement created (BindingEdge): the run that began its chain
    # (a trigger's run: schedule, manual, API). NULL: this run began a chain itself. A
    # plain UUID, not a foreign key: retention may delete the root before its chain.
    chain_root_id = models.UUIDField(null=True, blank=True, editable=False)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("cancel_run", "Can cancel a run"),
            ("retry_run", "Can retry a failed or cancelled run"),
            ("run_now", "Can make a run waiting on backoff available now"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="dispatch_run_idempotency_key_uniq",
            ),
            models.UniqueConstraint(
                fields=["schedule_id", "scheduled_for"], name="dispatch_run_schedule_slot_uniq"
            ),
            models.CheckConstraint(
                condition=Q(status__in=Status.values), name="dispatch_run_status_valid"
            ),
            models.CheckConstraint(
                condition=~Q(status=Status.RETRY_SCHEDULED), name="dispatch_run_status_not_retry"
            ),
            # One run per slice of a plan (an operator retry adds attempts to it).
            models.UniqueConstraint(
                fields=["parent", "slice_number"], name="dispatch_run_slice_uniq"
            ),
            models.CheckConstraint(
                condition=Q(parent__isnull=True, slice_number__isnull=True)
                | Q(parent__isnull=False, slice_number__gte=1),
                name="dispatch_run_slice_has_number",
            ),
            # A slice is never sliced itself.
            models.CheckConstraint(
                condition=Q(parent__isnull=True) | ~Q(status=Status.WAITING),
                name="dispatch_run_slice_not_waiting",
            ),
            # One run per binding in a chain: the key that makes every edge fire once
            # (dispatch_chain_fire inserts ON CONFLICT DO NOTHING), and the lookup of a
            # chain's runs (the fan-in's upstreams, the console's chain).
            models.UniqueConstraint(
                fields=["chain_root_id", "binding"],
                condition=Q(chain_root_id__isnull=False),
                name="dispatch_run_chain_uniq",
            ),
        ]
        indexes = [
            # The admin's run list and the overview: newest first, filtered by status.
            models.Index(fields=["status", "-created_at"], name="dispatch_run_status_idx"),
            # Runs of one binding (admin filter; the claim's capacity count joins through it).
            models.Index(fields=["binding", "-created_at"], name="dispatch_run_binding_idx"),
            # The claim's capacity count: RUNNING runs of one binding
            # (dispatch_claim_v5, dispatch_binding_state).
            models.Index(
                fields=["binding"],
                condition=Q(status=Status.RUNNING),
                name="dispatch_run_running_idx",
            ),
            # Finished-per-hour chart of the overview.
            models.Index(
                fields=["finished_at"],
                name="dispatch_run_finished_idx",
                condition=Q(finished_at__isnull=False),
            ),
            # The run list unfiltered (or by a filter without an index of its own): newest
            # first, read in index order, never sorted (docs/console.md, "At scale").
            models.Index(fields=["-created_at"], name="dispatch_run_created_idx"),
            models.Index(fields=["trigger", "-created_at"], name="dispatch_run_trigger_idx"),
            # A bulk operation's batch over a status filter (retry the FAILED, cancel the
            # PENDING): the next rows of that status after the keyset cursor, by primary
            # key, a range read whatever the table's size (dispatch.ops.bulk). Partial:
            # SUCCEEDED (most of a history) is left out, and so is every lookup by id
            # alone, which an index on (status, id) would otherwise serve as a whole
            # index scan when the planner's statistics are those of an empty table.
            models.Index(
                fields=["status", "id"],
                name="dispatch_run_status_id_idx",
                condition=models.Q(status__in=BULK_INDEXED_STATUSES),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.binding_id and self.binding.name} {self.id}"

    @property
    def is_live(self) -> bool:
        return self.status in LIVE_STATUSES

    @property
    def is_slice(self) -> bool:
        return self.parent_id is not None

    @property
    def chain_root(self) -> uuid.UUID:
        """The run that began this run's chain (itself when it began one)."""
        return self.chain_root_id or self.id


class SlicePlan(models.Model):
    """The plan of a sliced run, written once by its planning attempt, and the counters
    its slices' settlements keep (in the settlement's transaction, under the parent run's
    lock: no scan of the slices). Not started yet: total - started; started = succeeded +
    failed + live."""

    run = models.OneToOneField(
        Run, on_delete=models.CASCADE, primary_key=True, related_name="slice_plan"
    )
    key = models.CharField(max_length=200)  # the column the ranges are on
    key_type = models.CharField(max_length=100)  # its type, as the source's catalog says
    method = models.CharField(max_length=20)  # count | rows_per_slice
    # How the bounds were chosen (min/max, histogram, ...) and what was asked, for display.
    basis = models.CharField(max_length=200, blank=True, default="")
    total = models.PositiveIntegerField()
    in_flight = models.PositiveIntegerField()  # the job's max_slices_in_flight, or total
    # The specs the slices run with, frozen at planning: a job edited meanwhile does not
    # give one run's slices different tables or modes.
    source_spec = BoundedJSONField(default=dict)
    sink_spec = BoundedJSONField(default=dict)
    succeeded = models.PositiveIntegerField(default=0)
    # Slices whose run ended FAILED or CANCELLED and has not been retried since.
    failed = models.PositiveIntegerField(default=0)
    live = models.PositiveIntegerField(default=0)  # slice runs PENDING or RUNNING
    # Slices started so far: they start in number order and never go back (a retry adds
    # an attempt to a slice's run), so the next one to start is number started + 1, one
    # unique-index lookup (a partial index of unstarted rows would fill with dead entries).
    started = models.PositiveIntegerField(default=0)
    rows_written = models.BigIntegerField(default=0)  # of the slices that succeeded
    # Why the run failed: the first slice that failed, named with its range.
    error = models.TextField(blank=True, default="")
    planned_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(total__gte=1, in_flight__gte=1), name="dispatch_sliceplan_total_min"
            ),
            models.CheckConstraint(
                condition=Q(succeeded__lte=models.F("total")),
                name="dispatch_sliceplan_succeeded_max",
            ),
        ]

    def __str__(self) -> str:
        return f"plan of run {self.run_id}: {self.total} slices on {self.key}"


class Slice(models.Model):
    """One range of a sliced run's plan. `run` is its slice run once started (NULL: not
    started yet; the settlement of a slice starts the next one, by number). A NULL bound is open:
    the first slice also holds the rows whose key is NULL and below the first bound, the
    last one those above the last bound, so every row belongs to exactly one slice."""

    id = models.BigAutoField(primary_key=True)
    parent = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    number = models.PositiveIntegerField()
    lower = models.TextField(null=True, blank=True)  # inclusive; NULL: open (and NULL keys)
    upper = models.TextField(null=True, blank=True)  # exclusive; NULL: open
    run = models.OneToOneField(
        Run, on_delete=models.SET_NULL, null=True, blank=True, related_name="slice"
    )
    rows_written = models.BigIntegerField(default=0)  # when its run SUCCEEDED

    class Meta:
        ordering = ["parent", "number"]
        constraints = [
            models.UniqueConstraint(fields=["parent", "number"], name="dispatch_slice_number_uniq"),
            models.CheckConstraint(condition=Q(number__gte=1), name="dispatch_slice_number_min"),
        ]

    def __str__(self) -> str:
        return f"slice {self.number} of run {self.parent_id}"


class AttemptQuerySet(models.QuerySet["Attempt"]):
    def live(self) -> AttemptQuerySet:
        return self.filter(_LIVE)

    def pending(self) -> AttemptQuerySet:
        return self.filter(status=Status.PENDING)

    def running(self) -> AttemptQuerySet:
        return self.filter(status=Status.RUNNING)

    def expired(self) -> AttemptQuerySet:
        return self.filter(status=Status.RUNNING, lease_until__lte=Now())

    def blocked(self) -> AttemptQuerySet:
        return self.filter(status=Status.PENDING, blocked_reason__isnull=False)


class Attempt(models.Model):
    """One try at a run. Claimed, heartbeated and settled only through guarded SQL."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own: dispatch_attempt_run_number_uniq (run, number) leads with it.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    number = models.PositiveIntegerField()
    origin = models.CharField(max_length=20, choices=Origin.choices, default=Origin.TRIGGER)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    available_at = models.DateTimeField(db_default=Now())
    blocked_reason = models.CharField(
        max_length=40, choices=BlockedReason.choices, null=True, blank=True
    )
    worker_id = models.CharField(max_length=200, null=True, blank=True)
    lease_token = models.BigIntegerField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    source = models.ForeignKey(
        Datasource, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    sink = models.ForeignKey(
        Datasource, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    # Copies of the datasources' ciphertexts taken by the claim; erased when the attempt
    # ends. The redacted copies stay for the record.
    source_snapshot = models.TextField(null=True, blank=True)
    sink_snapshot = models.TextField(null=True, blank=True)
    source_redacted = BoundedJSONField(null=True, blank=True)
    sink_redacted = BoundedJSONField(null=True, blank=True)
    source_version = models.PositiveIntegerField(null=True, blank=True)
    sink_version = models.PositiveIntegerField(null=True, blank=True)
    datasources_resolved_at = models.DateTimeField(null=True, blank=True)
    reason = models.CharField(max_length=40, choices=Reason.choices, null=True, blank=True)
    error = models.TextField(blank=True, default="")
    rows_read = models.BigIntegerField(default=0)
    rows_written = models.BigIntegerField(default=0)
    # How many rows the source expects to read (the planner's estimate, or an exact count
    # where that is cheap), recorded right after the first heartbeat of the read: the
    # progress bar's total, and with rows_read and the claim and heartbeat times (database
    # time) its rate and time left. Null: no estimate (none given, or the run ended first).
    rows_estimated = models.BigIntegerField(null=True, blank=True, editable=False)
    # An incremental read (dispatch/connectors/incremental.py): the cursor the attempt
    # started from (the sink's committed one, else the spec's start; null: the whole
    # source) and the one it commits with its rows (the highest in its snapshot).
    cursor_from = models.JSONField(null=True, blank=True, editable=False)
    cursor_to = models.JSONField(null=True, blank=True, editable=False)
    # The receipt of a delivery its sink committed (docs/connectors.md, "Receipts"): the
    # rows and their digest (16 hex digits; NULL when the rows did not stream as text),
    # recorded by the worker after the sink's commit; and the last verification of it on
    # the sink (`check_invariants --receipts`): when, and what it found.
    receipt_rows = models.BigIntegerField(null=True, blank=True, editable=False)
    receipt_digest = models.CharField(max_length=16, null=True, blank=True, editable=False)
    receipt_verified_at = models.DateTimeField(null=True, blank=True, editable=False)
    receipt_verification = models.TextField(null=True, blank=True, editable=False)
    # The schema changes its sink made or found in the data transaction that committed its
    # rows (docs/connectors.md, "Schema changes"): a list of {column, change, type, from};
    # NULL when there were none.
    schema_changes = models.JSONField(null=True, blank=True, editable=False)
    # The event log's counters (AttemptEvent; sql/functions/events.sql): how many events
    # the worker offered (written with the heartbeats and the settlement), and how many
    # of them the cap (DISPATCH_EVENTS_PER_ATTEMPT) or the worker's full buffer left out.
    events_seen = models.IntegerField(db_default=0, editable=False)
    events_dropped = models.IntegerField(db_default=0, editable=False)

    objects = AttemptQuerySet.as_manager()

    class Meta:
        ordering = ["run", "number"]
        permissions = [("release_attempt", "Can release a running attempt")]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "number"], name="dispatch_attempt_run_number_uniq"
            ),
            # At most one live attempt per run: the last line of defence against a second
            # successor from concurrent recovery passes or operator actions.
            models.UniqueConstraint(
                fields=["run"], condition=_LIVE, name="dispatch_attempt_one_live_per_run"
            ),
            models.CheckConstraint(condition=Q(number__gte=1), name="dispatch_attempt_number_min"),
            models.CheckConstraint(
                condition=Q(status__in=Status.values), name="dispatch_attempt_status_valid"
            ),
            models.CheckConstraint(
                condition=~Q(status=Status.WAITING), name="dispatch_attempt_status_not_waiting"
            ),
            models.CheckConstraint(
                condition=~Q(status=Status.RUNNING)
                | (
                    Q(lease_token__isnull=False)
                    & Q(lease_until__isnull=False)
                    & Q(worker_id__isnull=False)
                    & Q(claimed_at__isnull=False)
                ),
                name="dispatch_attempt_running_has_lease",
            ),
            models.CheckConstraint(
                condition=Q(status__in=[Status.PENDING, Status.RUNNING])
                | Q(finished_at__isnull=False),
                name="dispatch_attempt_finished_has_time",
            ),
            models.CheckConstraint(
                condition=Q(status=Status.RUNNING)
                | (Q(source_snapshot__isnull=True) & Q(sink_snapshot__isnull=True)),
                name="dispatch_attempt_snapshot_only_while_running",
            ),
        ]
        indexes = [
            # The worker's timer for the earliest future available_at (the
            # next_available_in statement) and the metrics' due attempts. The claim walks
            # dispatch_attempt_ready_idx (sql/functions/claim.sql).
            models.Index(
                fields=["available_at", "id"],
                condition=Q(status=Status.PENDING),
                name="dispatch_attempt_pending_idx",
            ),
            # Recovery (dispatch_recover_v2: lease_until <= clock_timestamp()) and the
            # worker's look at the queue (dispatch_queue_view_v4: the earliest expiry).
            models.Index(
                fields=["lease_until"],
                condition=Q(status=Status.RUNNING),
                name="dispatch_attempt_running_idx",
            ),
            # The admin's attempt list and the overview's failures in the last 24 h.
            models.Index(fields=["status", "-created_at"], name="dispatch_attempt_status_idx"),
            # The attempt list unfiltered, newest first; the overview's failures of the
            # last 24 h (docs/console.md, "At scale").
            models.Index(fields=["-created_at"], name="dispatch_attempt_created_idx"),
            models.Index(
                fields=["finished_at"],
                name="dispatch_attempt_finished_idx",
                condition=Q(finished_at__isnull=False),
            ),
            # The attempt list's filters, each read newest first (the partial ones hold
            # only the rows that carry a reason).
            models.Index(fields=["origin", "-created_at"], name="dispatch_attempt_origin_idx"),
            models.Index(
                fields=["reason", "-created_at"],
                name="dispatch_attempt_reason_idx",
                condition=Q(reason__isnull=False),
            ),
            models.Index(
                fields=["blocked_reason", "-created_at"],
                name="dispatch_attempt_blocked_idx",
                condition=Q(blocked_reason__isnull=False),
            ),
            # The health scan's schema-change alerts: the attempts of the runs it read
            # that changed a sink's columns (a few), whatever the statistics say.
            models.Index(
                fields=["run"],
                name="dispatch_attempt_schema_idx",
                condition=Q(schema_changes__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of run {self.run_id}"


class AttemptEvent(models.Model):
    """One event of an attempt's log: what its worker saw (claimed, connected, a lock
    wait, progress, the fence raised, committed, an error) or its settlement. Written only
    by the SQL of the heartbeat and the settlement, guarded by the attempt's lease token
    (sql/functions/events.sql); read-only everywhere else."""

    id = models.BigAutoField(primary_key=True)
    # No index of its own: dispatch_attemptevent_seq_uniq (attempt, seq) leads with it.
    attempt = models.ForeignKey(
        Attempt, on_delete=models.CASCADE, related_name="events", db_index=False
    )
    # The event's place in its attempt's log, from 1 (numbers left out were dropped).
    seq = models.IntegerField()
    # When the worker saw it: the database's clock at the write, minus how long before
    # the write the worker saw it (its monotonic clock), never the worker's wall clock.
    at = models.DateTimeField()
    # What happened: claimed, connected, lock_wait, read_started, progress, fence_raised,
    # committed, error, settled (EVENT_KINDS in dispatch/worker/events.py).
    kind = models.CharField(max_length=40)
    # One line for a reader, sanitized like a stored error (no secrets).
    message = models.TextField(blank=True, default="")
    # The event's numbers and names (rows, bytes, seconds, server versions, error class).
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["attempt", "seq"]
        constraints = [
            # The timeline of an attempt, in order (the run page, the API, `runs show`),
            # and the delete of a pruned run's events (retention).
            models.UniqueConstraint(
                fields=["attempt", "seq"], name="dispatch_attemptevent_seq_uniq"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.seq} of attempt {self.attempt_id}"


class BindingCursor(models.Model):
    """The console's copy of a binding's committed incremental cursor.

    The sink holds the truth (`dispatch_cursor`, committed with the rows); this copy is
    written after each incremental attempt read or moved it and after an operator's reset
    or set, and only ever forward (by the sink's version). Nothing reads it to decide what
    to copy."""

    binding = models.OneToOneField(
        JobBinding, on_delete=models.CASCADE, primary_key=True, related_name="cursor_copy"
    )
    columns = models.JSONField(null=True, blank=True)
    cursor = models.JSONField(null=True, blank=True)
    version = models.BigIntegerField(default=0)
    # Not foreign keys: retention may prune the run; the copy keeps naming it.
    run_id = models.UUIDField(null=True, blank=True)
    attempt_id = models.UUIDField(null=True, blank=True)
    changed_by = models.CharField(max_length=200, blank=True, default="")
    committed_at = models.DateTimeField(null=True, blank=True)
    recorded_at = models.DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "binding cursor"

    def __str__(self) -> str:
        return f"cursor of {self.binding_id} at version {self.version}"


class Worker(models.Model):
    """A `runworker` process, registered at start and heartbeated with its attempts."""

    id = models.CharField(max_length=200, primary_key=True)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    concurrency = models.PositiveIntegerField()
    started_at = models.DateTimeField(db_default=Now())
    heartbeat_at = models.DateTimeField(db_default=Now())
    stopped_at = models.DateTimeField(null=True, blank=True)
    # Counters the worker reports with its heartbeat (claims by path, leases lost, fenced
    # sink commits, ...), for the console and the benchmarks.
    stats = BoundedJSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return self.id


class Overview(Run):
    """No table of its own: the admin index's entry for the console's overview page (the
    app ships it, so a host site needs no template of its own to reach it)."""

    class Meta:
        proxy = True
        verbose_name = "overview"
        verbose_name_plural = "overview"
        default_permissions = ()  # seen by whoever may view runs
