from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import psycopg
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from psycopg import sql

from dispatch.connectors.csv import check_base_dir
from dispatch.models import Datasource, Job, JobBinding

DEMO_SOURCE_DB = "dispatch_demo_source"
DEMO_SINK_DB = "dispatch_demo_sink"


def _datasource(name: str, kind: str, config: dict[str, Any]) -> tuple[Datasource, bool]:
    """get_or_create by name (config is a property stored encrypted, not a field)."""
    existing = Datasource.objects.filter(name=name).first()
    if existing is not None:
        return existing, False
    datasource = Datasource(name=name, kind=kind)
    datasource.config = config
    datasource.save()
    return datasource, True


class Command(BaseCommand):
    help = "Create a demo (datasources, jobs, bindings) and an admin login; idempotent."

    def add_arguments(self, parser: Any) -> None:
        # A file, never the password itself: a command line is visible to every local
        # user (ps, /proc/<pid>/cmdline) and lands in shell history.
        parser.add_argument(
            "--admin-password-file",
            default=None,
            help="set the 'admin' login to the password in this file (default: a new "
            "random one when the user does not exist yet)",
        )
        parser.add_argument(
            "--csv-dir",
            default=None,
            help="the CSV demo's directory, inside DISPATCH_CSV_BASE_DIRS (created; "
            "default: no CSV demo)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with transaction.atomic():
            generate, _ = _datasource("demo-generator", "generate", {})
            discard, _ = _datasource("demo-discard", "null", {})
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
        self._seed_connector_demos(options["csv_dir"])
        user_model = get_user_model()
        user = user_model.objects.filter(username="admin").first()
        password = None
        if options["admin_password_file"]:
            try:
                with open(options["admin_password_file"], encoding="utf-8") as f:
                    password = f.read().strip()
            except OSError as exc:
                raise CommandError(f"cannot read --admin-password-file: {exc.strerror}") from None
            if not password:
                raise CommandError("--admin-password-file is empty")
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

    # --- PostgreSQL and CSV demos -------------------------------------------------------
    def _seed_connector_demos(self, csv_dir: str | None) -> None:
        """Two databases on the dispatch server (a 100k-row `orders` source and a sink), a
        PostgreSQL -> PostgreSQL binding and, with `csv_dir`, a CSV -> PostgreSQL binding.
        Idempotent."""
        s = connection.settings_dict
        server: dict[str, Any] = {
            "host": s.get("HOST") or "127.0.0.1",
            "port": int(s.get("PORT") or 5432),
            "user": s.get("USER") or "postgres",
        }
        if s.get("PASSWORD"):
            server["password"] = s["PASSWORD"]
        try:
            self._ensure_demo_databases(server)
        except psycopg.Error as exc:
            self.stdout.write(f"  (PostgreSQL demo skipped: {type(exc).__name__})")
            return
        with transaction.atomic():
            source, _ = _datasource(
                "demo-pg-source", "postgresql", {**server, "dbname": DEMO_SOURCE_DB}
            )
            sink, _ = _datasource("demo-pg-sink", "postgresql", {**server, "dbname": DEMO_SINK_DB})
            pg_job, _ = Job.objects.get_or_create(
                name="demo-orders-copy",
                defaults={
                    "source_spec": {"table": "public.orders"},
                    "sink_spec": {"table": "public.orders_copy", "mode": "replace", "create": True},
                    "description": "Copy 100,000 orders between two PostgreSQL databases.",
                },
            )
            JobBinding.objects.get_or_create(
                name="demo-orders-pg-to-pg",
                defaults={"job": pg_job, "source": source, "sink": sink},
            )
        if csv_dir is not None:
            self._seed_csv_demo(Path(csv_dir).absolute(), sink)

    def _seed_csv_demo(self, csv_dir: Path, sink: Datasource) -> None:
        """A small orders.csv in `csv_dir` and a CSV -> PostgreSQL binding reading it."""
        refused = check_base_dir(str(csv_dir))
        if refused:
            self.stdout.write(f"  (CSV demo skipped: {refused})")
            return
        csv_dir.mkdir(parents=True, exist_ok=True)
        orders_csv = csv_dir / "orders.csv"
        if not orders_csv.exists():
            orders_csv.write_text(
                "id,customer,amount,note\n"
                '1,ACME,19.99,"first order, with a comma"\n'
                '2,Zoë & Co,5.00,"two\nlines"\n'
                '3,"Quote ""Inc""",120.50,\n',
                encoding="utf-8",
            )
        with transaction.atomic():
            files, _ = _datasource("demo-csv-files", "csv", {"base_dir": str(csv_dir)})
            if files.config != {"base_dir": str(csv_dir)}:  # made by an older demo
                files.config = {"base_dir": str(csv_dir)}
                files.save()
            csv_job, _ = Job.objects.get_or_create(
                name="demo-orders-csv-load",
                defaults={
                    "source_spec": {"path": "orders.csv", "null": ""},
                    "sink_spec": {"table": "public.orders_csv", "mode": "replace", "create": True},
                    "description": "Load a small CSV file into PostgreSQL.",
                },
            )
            JobBinding.objects.get_or_create(
                name="demo-orders-csv-to-pg",
                defaults={"job": csv_job, "source": files, "sink": sink},
            )

    def _ensure_demo_databases(self, server: dict[str, Any]) -> None:
        dbname = connection.settings_dict.get("NAME") or "postgres"
        with psycopg.connect(**server, dbname=dbname, autocommit=True) as admin:
            existing = {
                r[0]
                for r in admin.execute(
                    "SELECT datname FROM pg_database WHERE datname = ANY(%s)",
                    [[DEMO_SOURCE_DB, DEMO_SINK_DB]],
                )
            }
            for name in (DEMO_SOURCE_DB, DEMO_SINK_DB):
                if name not in existing:
                    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        with psycopg.connect(**server, dbname=DEMO_SOURCE_DB, autocommit=True) as src:
            if src.execute("SELECT to_regclass('public.orders')").fetchone() == (None,):
                # Deterministic rows, generated on the server in one statement (well under
                # a second for 100k rows).
                src.execute(
                    "CREATE TABLE public.orders AS SELECT i::bigint AS id,"
                    " 'customer-' || lpad((i % 1000)::text, 4, '0') AS customer,"
                    " ((i * 7919) % 100000 / 100.0)::numeric(12,2) AS amount,"
                    " timestamptz '2024-01-01 00:00:00+00' + i * interval '1 minute' AS created_at"
                    " FROM generate_series(1, 100000) AS i"
                )
                src.execute("ALTER TABLE public.orders ADD PRIMARY KEY (id)")
