"""A real PgBouncer (Debian's `pgbouncer`) in transaction-pooling mode, started on a free
port with a configuration of its own in a temporary directory, in front of a PostgreSQL
server: for the tests (tests/worker/test_pgbouncer.py) and the benchmark (bench/pgbouncer.py).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

EXECUTABLE = "/usr/sbin/pgbouncer"


def find() -> str | None:
    if Path(EXECUTABLE).exists():
        return EXECUTABLE
    return shutil.which("pgbouncer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """`pool_size` server connections per database/user pair; clients beyond that wait
    for one (transaction pooling: a client holds a server connection only during a
    transaction)."""

    def __init__(
        self,
        directory: Path,
        *,
        server_host: str,
        server_port: int,
        pool_size: int = 10,
        max_client_conn: int = 500,
    ) -> None:
        self.directory = directory
        self.server_host = server_host
        self.server_port = server_port
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.port = free_port()
        self.log_path = directory / "pgbouncer.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        lines = [
            "[databases]",
            f"* = host={self.server_host} port={self.server_port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.directory / 'users.txt'}",
            "pool_mode = transaction",
            f"default_pool_size = {self.pool_size}",
            "reserve_pool_size = 0",
            f"max_client_conn = {self.max_client_conn}",
            "ignore_startup_parameters = extra_float_digits",
            "server_reset_query =",
        ]
        if os.geteuid() == 0:
            # PgBouncer refuses to run as root; it reads this file, then drops to the user.
            lines.append(f"user = {_unprivileged_user()}")
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 20.0) -> None:
        executable = find()
        if executable is None:
            raise FileNotFoundError("pgbouncer is not installed (apt-get install -y pgbouncer)")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "users.txt").write_text('"postgres" ""\n')
        ini = self.directory / "pgbouncer.ini"
        ini.write_text(self.config())
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [executable, str(ini)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while "listening on 127.0.0.1" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer did not start:\n{self.log()[-2000:]}")
            time.sleep(0.05)

    def url(self, database: str, user: str = "postgres") -> str:
        return f"postgres://{user}@127.0.0.1:{self.port}/{database}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def logins(self, database: str) -> int:
        """Client logins PgBouncer has seen for `database` (each is one client connection)."""
        return self.log().count(f"login attempt: db={database} ")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("no unprivileged user to run pgbouncer as (postgres or nobody)")
