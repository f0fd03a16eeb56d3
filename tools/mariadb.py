"""A MariaDB server of our own (Debian's `mariadb-server` binaries), started in a temporary
data directory on a port of its own, TCP on 127.0.0.1 and a Unix socket in that directory:
for the tests (tests/connectors/mysql) and the benchmark (bench/copy_pg.py). Never the
system's server.

Grants are real (no --skip-grant-tables): `admin_user` is made with every privilege and a
password, and tests make least-privilege users of their own. Under root the server runs
as root (`--user=root`): its files live in the temporary directory only.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

SERVER = "/usr/sbin/mariadbd"
INSTALL_DB = "/usr/bin/mariadb-install-db"
PORT_VARIABLE = "DISPATCH_TEST_MARIADB_PORT"
DEFAULT_PORT = 33071


def find() -> str | None:
    """The server binary, or None when MariaDB is not installed."""
    for path in (SERVER, shutil.which("mariadbd") or ""):
        if (
            path
            and Path(path).exists()
            and (Path(INSTALL_DB).exists() or shutil.which("mariadb-install-db"))
        ):
            return path
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def choose_port() -> int:
    """`DISPATCH_TEST_MARIADB_PORT` (default 33071), or the next free one above it when it
    is busy (another checkout's server)."""
    port = int(os.environ.get(PORT_VARIABLE) or DEFAULT_PORT)
    for candidate in range(port, port + 100):
        if _port_free(candidate):
            return candidate
    raise RuntimeError(f"no free port for MariaDB from {port} ({PORT_VARIABLE})")


class MariaDB:
    admin_user = "dispatch_admin"
    admin_password = "admin-secret-pw"

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.datadir = directory / "data"
        self.socket = directory / "mysqld.sock"
        self.log_path = directory / "mariadbd.log"
        self.port = port or choose_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def _user_args(self) -> list[str]:
        return ["--user=root"] if os.geteuid() == 0 else []

    def start(self, timeout: float = 60.0) -> None:
        server = find()
        if server is None:
            raise FileNotFoundError("MariaDB is not installed (apt-get install -y mariadb-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        install = shutil.which("mariadb-install-db") or INSTALL_DB
        subprocess.run(
            [
                install,
                "--no-defaults",
                f"--datadir={self.datadir}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                *self._user_args(),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    server,
                    "--no-defaults",
                    f"--datadir={self.datadir}",
                    f"--socket={self.socket}",
                    f"--port={self.port}",
                    "--bind-address=127.0.0.1",
                    f"--pid-file={self.directory / 'mariadbd.pid'}",
                    "--skip-name-resolve",
                    "--innodb-buffer-pool-size=64M",
                    "--innodb-log-file-size=48M",
                    "--innodb-flush-log-at-trx-commit=2",
                    "--character-set-server=utf8mb4",
                    "--collation-server=utf8mb4_bin",
                    "--local-infile=1",
                    "--max-connections=200",
                    *self._user_args(),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = self.root()
                break
            except Exception:  # noqa: BLE001 - any failure to connect means "not up yet"
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"mariadbd did not start:\n{self.log()[-3000:]}") from None
                time.sleep(0.1)
        with conn.cursor() as cur:
            cur.execute(
                "CREATE USER IF NOT EXISTS %s@'%%' IDENTIFIED BY %s",
                [self.admin_user, self.admin_password],
            )
            cur.execute(f"GRANT ALL PRIVILEGES ON *.* TO `{self.admin_user}`@'%' WITH GRANT OPTION")
        conn.close()

    def root(self, **kwargs: Any) -> Any:
        """A connection as root over the Unix socket (administration only)."""
        import pymysql

        return pymysql.connect(unix_socket=str(self.socket), user="root", autocommit=True, **kwargs)

    def config(self, database: str, **extra: Any) -> dict[str, Any]:
        """A `mysql` datasource config for `database` as the admin user."""
        return {
            "host": "127.0.0.1",
            "port": self.port,
            "database": database,
            "user": self.admin_user,
            "password": self.admin_password,
            **extra,
        }

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
