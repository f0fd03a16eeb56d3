"""API tokens: how a program (an orchestrator, a CI job) authenticates to the HTTP API.

A token is `dsp_<prefix>_<secret>`: the prefix is public (it names the row, so a lookup is
one index probe), the secret is 32 random bytes. Only the SHA-256 of the whole token is
stored: a 256-bit random secret cannot be guessed from its hash, so a slow password hash
would only cost time on every request. The token carries the permissions of its user,
optionally narrowed to some bindings; an expired or revoked token, or one whose user is
inactive, authenticates nobody.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

TOKEN_PREFIX = "dsp_"
# The public part's length (url-safe characters): enough to make a clash rare; the
# unique index refuses one, and `issue` draws again.
PUBLIC_LENGTH = 10
# last_used_at is written at most once per this interval: a busy token costs no write per
# request.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def split(token: str) -> str | None:
    """The public prefix of a well-formed token, or None."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    public, sep, secret = token[len(TOKEN_PREFIX) :].partition("_")
    if not sep or len(public) != PUBLIC_LENGTH or not secret:
        return None
    return public


class ApiTokenQuerySet(models.QuerySet["ApiToken"]):
    def usable(self) -> ApiTokenQuerySet:
        """Neither revoked nor expired (database time)."""
        return self.filter(revoked_at__isnull=True, expires_at__gt=Now())


class ApiToken(models.Model):
    """A named bearer token of one user; its secret is shown once, at creation."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, help_text="What uses it, e.g. “airflow-prod”.")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="dispatch_api_tokens",
        help_text="The token acts as this user, with this user's permissions.",
    )
    # The public part of the token: the lookup key (its unique index), shown in the console.
    prefix = models.CharField(max_length=PUBLIC_LENGTH, unique=True, editable=False)
    # SHA-256 (hex) of the whole token; never shown.
    secret_hash = models.CharField(max_length=64, editable=False)
    bindings = models.ManyToManyField(
        "dispatch.JobBinding",
        blank=True,
        related_name="+",
        help_text="Bindings this token may act on; none selected: every binding its user may.",
    )
    # Whether `bindings` narrows the token (set once, with them). Kept apart from the list:
    # a binding deleted later leaves a narrowed token narrower, never unbounded.
    scoped = models.BooleanField(default=False, editable=False)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    expires_at = models.DateTimeField(help_text="After this moment the token is refused.")
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        verbose_name = "API token"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({TOKEN_PREFIX}{self.prefix}_…)"

    @property
    def active(self) -> bool:
        return self.revoked_at is None and self.expires_at > timezone.now()

    def matches(self, token: str) -> bool:
        """Whether `token` is this token (constant time over the digests)."""
        return hmac.compare_digest(digest(token), self.secret_hash)

    @classmethod
    def issue(
        cls, *, name: str, user: Any, expires_at: datetime, bindings: Sequence[Any] = ()
    ) -> tuple[ApiToken, str]:
        """A new token row and the token itself (the only time it exists in clear),
        narrowed to `bindings` when some are given."""
        row = cls(name=name, user=user, expires_at=expires_at, scoped=bool(bindings))
        token = row.new_secret()
        with transaction.atomic():
            row.save()
            if bindings:
                row.bindings.set(bindings)
        return row, token

    def new_secret(self) -> str:
        """Give the row a fresh prefix and secret; returns the token."""
        while True:
            public = secrets.token_urlsafe(16).replace("-", "x").replace("_", "y")[:PUBLIC_LENGTH]
            if not ApiToken.objects.filter(prefix=public).exists():
                break
        token = f"{TOKEN_PREFIX}{public}_{secrets.token_urlsafe(32)}"
        self.prefix = public
        self.secret_hash = digest(token)
        return token

    def touch(self) -> None:
        """Record a use, at most once per LAST_USED_RESOLUTION: a conditional update that
        changes nothing while the stored time is recent (and is not even sent then)."""
        now = timezone.now()
        if self.last_used_at is not None and now - self.last_used_at < LAST_USED_RESOLUTION:
            return
        ApiToken.objects.filter(pk=self.pk).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=Now() - LAST_USED_RESOLUTION)
        ).update(last_used_at=Now())
