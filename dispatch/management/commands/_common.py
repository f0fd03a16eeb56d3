"""Helpers shared by the management commands: resolve ids and names into rows."""

from __future__ import annotations

import uuid

from django.core.management.base import CommandError

from dispatch.models import Attempt, JobBinding, Run


def _uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def binding_from_arg(value: str) -> JobBinding:
    """A binding by id or by name."""
    as_id = _uuid(value)
    binding = (
        JobBinding.objects.filter(pk=as_id).first() if as_id else None
    ) or JobBinding.objects.filter(name=value).first()
    if binding is None:
        raise CommandError(f"No binding with id or name {value!r}.")
    return binding


def run_from_arg(value: str) -> Run:
    as_id = _uuid(value)
    if as_id is None:
        raise CommandError(f"{value!r} is not a run id (a UUID).")
    run = Run.objects.filter(pk=as_id).first()
    if run is None:
        raise CommandError(f"No run with id {value}.")
    return run


def attempt_from_arg(value: str) -> Attempt:
    as_id = _uuid(value)
    if as_id is None:
        raise CommandError(f"{value!r} is not an attempt id (a UUID).")
    attempt = Attempt.objects.filter(pk=as_id).first()
    if attempt is None:
        raise CommandError(f"No attempt with id {value}.")
    return attempt
