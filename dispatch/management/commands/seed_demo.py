from __future__ import annotations

import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from dispatch.models import Datasource, Job, JobBinding


class Command(BaseCommand):
    help = "Create a demo (datasources, jobs, bindings) and an admin login; idempotent."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--admin-password",
            default=None,
            help="set the 'admin' login to this password (default: a new random one "
            "when the user does not exist yet)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with transaction.atomic():
            generate, _ = Datasource.objects.get_or_create(
                name="demo-generator", defaults={"kind": "generate", "config": {}}
            )
            discard, _ = Datasource.objects.get_or_create(
                name="demo-discard", defaults={"kind": "null", "config": {}}
            )
            job, _ = Job.objects.get_or_create(
                name="demo-generate-100k",
                defaults={
                    "source_spec": {"rows": 100_000, "batch": 5000, "delay_ms": 50, "seed": 1},
                    "sink_spec": {},
                    "description": "100,000 generated rows, discarded.",
                },
            )
            JobBinding.objects.get_or_create(
                name="demo-generate-to-null",
                defaults={"job": job, "source": generate, "sink": discard},
            )
        user_model = get_user_model()
        user = user_model.objects.filter(username="admin").first()
        password = options["admin_password"]
        if user is None:
            password = password or secrets.token_urlsafe(12)
            user_model.objects.create_superuser("admin", "admin@example.com", password)
        elif password:
            user.set_password(password)
            user.save(update_fields=["password"])
        if password:
            self.stdout.write(f"  Login:  admin / {password}")
        else:
            self.stdout.write("  Login:  admin (password unchanged)")
