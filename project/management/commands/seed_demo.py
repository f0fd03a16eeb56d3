from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import psycopg
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from psycopg import sql

from dispatch.connectors.csv import check_base_dir

DEMO_SOURCE_DB = "dispatch_demo_source"
DEMO_SINK_DB = "dispatch_demo_sink"


class Command(BaseCommand):
    help = (
        "Create the demo's data (the PostgreSQL source and sink databases, the CSV file) and "
        "an admin login; idempotent. The demo's definitions are project/demo/*.yaml, applied "
        "with `manage.py dispatch apply`."
    )

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
            "default: no CSV file)",
        )
        parser.add_argument(
            "--source-db",
            default=DEMO_SOURCE_DB,
            help=f"the database made for the 100k-row orders table (default {DEMO_SOURCE_DB}), "
            "on the site's server",
        )
        parser.add_argument(
            "--sink-db",
            default=DEMO_SINK_DB,
            help=f"the database the demo's copies go to (default {DEMO_SINK_DB})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self._seed_databases(options["source_db"], options["sink_db"])
        if options["csv_dir"] is not None:
            self._seed_csv_file(Path(options["csv_dir"]).absolute())
        self._seed_login(options["admin_password_file"])

    def _seed_login(self, password_file: str | None) -> None:
        user_model = get_user_model()
        user = user_model.objects.filter(username="admin").first()
        password = None
        if password_file:
            try:
                with open(password_file, encoding="utf-8") as f:
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

    # --- PostgreSQL and CSV data ------------------------------------------------------
    def _seed_databases(self, source_db: str, sink_db: str) -> None:
        """The source and sink databases on the site's server, the source with a 100k-row
        `orders` table. Idempotent; a server that refuses is reported, not fatal (the
        PostgreSQL binding's runs then fail saying why)."""
        s = connection.settings_dict
        server: dict[str, Any] = {
            "host": s.get("HOST") or "127.0.0.1",
            "port": int(s.get("PORT") or 5432),
            "user": s.get("USER") or "postgres",
        }
        if s.get("PASSWORD"):
            server["password"] = s["PASSWORD"]
        try:
            self._ensure_demo_databases(server, source_db, sink_db)
        except psycopg.Error as exc:
            self.stdout.write(f"  (PostgreSQL demo databases not made: {type(exc).__name__})")

    def _seed_csv_file(self, csv_dir: Path) -> None:
        """A small orders.csv in `csv_dir`, which the CSV demo's binding reads."""
        refused = check_base_dir(str(csv_dir))
        if refused:
            self.stdout.write(f"  (CSV demo file not written: {refused})")
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

    def _ensure_demo_databases(self, server: dict[str, Any], source_db: str, sink_db: str) -> None:
        dbname = connection.settings_dict.get("NAME") or "postgres"
        with psycopg.connect(**server, dbname=dbname, autocommit=True) as admin:
            existing = {
                r[0]
                for r in admin.execute(
                    "SELECT datname FROM pg_database WHERE datname = ANY(%s)",
                    [[source_db, sink_db]],
                )
            }
            for name in (source_db, sink_db):
                if name not in existing:
                    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        with psycopg.connect(**server, dbname=source_db, autocommit=True) as src:
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
