from __future__ import annotations

import os
import secrets
import urllib.parse
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
# A MariaDB (or MySQL) server for the demo's MariaDB -> PostgreSQL binding, when set:
# mysql://user:password@host:port/database (the database is made if missing).
MYSQL_URL_VARIABLE = "DISPATCH_DEMO_MYSQL_URL"
MYSQL_DEMO_ROWS = 20_000


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
        # The URL holds a password: read from the environment only, never an argument
        # (a command line is visible to every user of the machine).
        mysql_url = os.environ.get(MYSQL_URL_VARIABLE)
        if mysql_url:
            self._seed_mysql(mysql_url)
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

    # --- MariaDB -----------------------------------------------------------------------
    def _seed_mysql(self, url: str) -> None:
        """An `orders` table on the MariaDB server of `url` and the binding that copies it
        into the demo's PostgreSQL sink (demo-pg-sink, from pipelines.yaml). A server that
        cannot be reached is reported, not fatal: `make run` goes on without it."""
        from dispatch.connectors import registry
        from dispatch.models import Datasource, Job, JobBinding

        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("mysql", "mariadb") or not parts.hostname:
            raise CommandError(
                f"{MYSQL_URL_VARIABLE} must be mysql://user:password@host:port/database"
            )
        config: dict[str, Any] = {
            "host": parts.hostname,
            "port": parts.port or 3306,
            "user": urllib.parse.unquote(parts.username or ""),
            "database": urllib.parse.unquote(parts.path.lstrip("/")) or "dispatch_demo",
        }
        if parts.password:
            config["password"] = urllib.parse.unquote(parts.password)
        try:
            connector = registry.get("mysql")
        except registry.UnknownKind:
            self.stdout.write("  (MariaDB demo skipped: install the `mysql` extra)")
            return
        import pymysql

        try:
            self._ensure_mysql_orders(config)
        except (pymysql.Error, OSError) as exc:  # the optional server: reported, not fatal
            self.stdout.write(f"  (MariaDB demo skipped: {type(exc).__name__})")
            return
        connector.validate_config(config)
        source = Datasource.objects.filter(name="demo-mariadb").first() or Datasource(
            name="demo-mariadb", kind="mysql"
        )
        if source.pk is None or source.config != config:
            source.config = config
            source.save()
        job, _ = Job.objects.update_or_create(
            name="demo-orders-mariadb-copy",
            defaults={
                "description": f"Copy {MYSQL_DEMO_ROWS:,} orders from MariaDB to PostgreSQL.",
                "source_spec": {"table": "orders"},
                "sink_spec": {"table": "public.orders_from_mariadb", "mode": "replace",
                              "create": True},
            },
        )  # fmt: skip
        sink = Datasource.objects.filter(name="demo-pg-sink").first()
        if sink is None:
            self.stdout.write("  (MariaDB demo binding not made: demo-pg-sink is missing)")
            return
        JobBinding.objects.update_or_create(
            name="demo-orders-mariadb-to-pg",
            defaults={"job": job, "source": source, "sink": sink},
        )
        self.stdout.write("  MariaDB demo: demo-orders-mariadb-to-pg")

    def _ensure_mysql_orders(self, config: dict[str, Any]) -> None:
        import pymysql  # the `mysql` extra (checked by the caller)

        database = config["database"]
        conn = pymysql.connect(
            host=config["host"],
            port=config["port"],
            user=config["user"],
            password=config.get("password", ""),
            connect_timeout=5,
            autocommit=True,
        )
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{database.replace('`', '')}`")
                cur.execute(f"USE `{database.replace('`', '')}`")
                cur.execute("SHOW TABLES LIKE 'orders'")
                if cur.fetchone():
                    return
                cur.execute(
                    "CREATE TABLE orders (id BIGINT PRIMARY KEY, customer VARCHAR(20),"
                    " amount DECIMAL(12,2), created_at DATETIME, tags SET('new','vip','late'),"
                    " attrs JSON)"
                )
                rows = [
                    (
                        i,
                        f"customer-{i % 1000:04d}",
                        f"{(i * 7919) % 100000 / 100:.2f}",
                        "2024-01-01 00:00:00",
                        ",".join(t for t, m in (("new", 2), ("vip", 5), ("late", 7)) if i % m == 0),
                        f'{{"tier": {i % 5}}}',
                    )
                    for i in range(1, MYSQL_DEMO_ROWS + 1)
                ]
                cur.executemany(
                    "INSERT INTO orders VALUES (%s, %s, %s, TIMESTAMPADD(MINUTE, %s, %s), %s, %s)",
                    [(r[0], r[1], r[2], r[0], r[3], r[4], r[5]) for r in rows],
                )
        finally:
            conn.close()

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
