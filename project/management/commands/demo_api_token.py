from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from dispatch.models import ApiToken

NAME = "demo"


class Command(BaseCommand):
    help = (
        "This repository's site only: give the demo login a fresh API token named 'demo' "
        "(the previous one is revoked) and print it, the only time it is shown."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", default="admin", help="the token's user (admin)")
        parser.add_argument("--url", default="", help="the API's address, printed beside it")
        parser.add_argument("--days", type=int, default=30, help="its lifetime in days (30)")

    def handle(self, *args: Any, **options: Any) -> None:
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"No user {options['username']!r}: run seed_demo first.")
        with transaction.atomic():
            # Only the hash is kept, so a token cannot be shown again: each run makes a
            # new one and revokes the one before.
            ApiToken.objects.filter(user=user, name=NAME, revoked_at__isnull=True).update(
                revoked_at=Now()
            )
            _, token = ApiToken.issue(
                name=NAME,
                user=user,
                expires_at=timezone.now() + timedelta(days=options["days"]),
            )
        where = f"{options['url']}  " if options["url"] else ""
        self.stdout.write(f"  API:    {where}Authorization: Bearer {token}")
