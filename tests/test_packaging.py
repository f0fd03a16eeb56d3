"""The package as a Django user gets it: build the wheel from the checkout, install it into
a fresh virtualenv that cannot see the repository, start a new `django-admin startproject`
site with both apps and use it: check, migrate, trigger a generate -> null run, drain it
with `runworker --burst`, and render every admin page of both apps on a custom admin site
under a URL prefix. The clear errors of a host site (SQLite, no key, a bad connector path,
an unmigrated database) are checked in that same site.

One wheel and one virtualenv per test session (pip's cache makes the install quick); the
newer Python's virtualenv of the README test is built at the same time."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import django
import psycopg
import pytest
from django.db import connection
from packaging.requirements import Requirement
from psycopg import sql

from tests.support.processes import test_database_url, wait_until

ROOT = Path(__file__).resolve().parent.parent
KEY = "7tLtvrDaR4N3B7yWAnMGz7CVGRHhKK0mFmGiZ1cxjbs="
SKIP_COPY = shutil.ignore_patterns(
    ".git", ".venv", ".data", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".env"
)

pytestmark = pytest.mark.slow


def run(args: list[str], *, cwd: Path, env: dict[str, str], ok: bool = True, timeout: float = 120):
    proc = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH, no Django settings and no database of the repository's own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "DJANGO_SETTINGS_MODULE", "DATABASE_URL", "VIRTUAL_ENV"}
        and not k.startswith("DISPATCH_")
    }
    env.update(extra)
    return env


def _setuptools_builds() -> bool:
    try:
        from importlib.metadata import version

        return int(version("setuptools").split(".")[0]) >= 77
    except Exception:  # noqa: BLE001 - not installed
        return False


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("checkout") / "src"
    shutil.copytree(ROOT, src, ignore=SKIP_COPY)
    out = tmp_path_factory.mktemp("wheel")
    # Without build isolation (no download) when this environment's setuptools can build
    # it (the dev extra pins one that can); otherwise pip fetches the build backend.
    isolation = [] if _setuptools_builds() else ["--use-pep517"]
    no_isolation = ["--no-build-isolation"] if not isolation else []
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            *no_isolation,
            *isolation,
            "--no-deps",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        cwd=src,
        env=clean_env(),
        timeout=300,
    )
    (built,) = out.glob("django_dispatch_sync-*.whl")
    return built


def make_venv(python: str, home: Path, wheel: Path) -> Path:
    """A fresh virtualenv of `python` with the wheel and a libpq installed by its own pip,
    as the README's install section does."""
    run([python, "-m", "venv", str(home)], cwd=home.parent, env=clean_env())
    run(
        [str(home / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel), "psycopg[binary]"],
        cwd=home.parent,
        env=clean_env(),
        timeout=300,
    )
    return home


@pytest.fixture(scope="session")
def newer_venv_build(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Future[Path] | None]:
    """The newer Python's virtualenv (readme_venv), built in the background beside the
    session's own: the two installs wait mostly on the package index, not on each other."""
    if not NEWER_PYTHON:
        yield None
        return
    home = tmp_path_factory.mktemp("venv-newer") / "env"
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(make_venv, NEWER_PYTHON[0], home, wheel)


@pytest.fixture(scope="session")
def venv(
    wheel: Path, newer_venv_build: Future[Path] | None, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return make_venv(sys.executable, tmp_path_factory.mktemp("venv") / "env", wheel)


def test_wheel__holds_every_file_the_apps_need_and_nothing_of_the_repository(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"dispatch", "scheduling", "django_dispatch_sync-0.1.0.dist-info"}, top
    assert not top & {"project", "tests", "bench", "docs", "tools"}
    for path in [
        *(ROOT / "dispatch" / "sql").rglob("*.sql"),
        *(ROOT / "scheduling" / "sql").rglob("*.sql"),
        *(ROOT / "dispatch" / "templates").rglob("*.html"),
        *(ROOT / "scheduling").glob("templates/**/*.html"),
        ROOT / "dispatch" / "ascode" / "schema.json",
    ]:
        assert path.relative_to(ROOT).as_posix() in names, f"{path} missing from the wheel"
    metadata = zipfile.ZipFile(wheel).read("django_dispatch_sync-0.1.0.dist-info/METADATA")
    text = metadata.decode()
    assert "License-Expression: MIT" in text
    assert "Requires-Dist: django-environ" in text and 'extra == "site"' in text
    # Demo and test commands belong to the repository's site only.
    for command in ("seed_demo", "demo_api_token", "chaos"):
        assert not [n for n in names if n.endswith(f"/commands/{command}.py")], command


def test_classifiers__name_django_5_2_and_6_and_the_django_the_suite_runs_on() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    prefix = "Framework :: Django :: "
    listed = [c.removeprefix(prefix) for c in project["classifiers"] if c.startswith(prefix)]
    assert "5.2" in listed and any(v.startswith("6.") for v in listed), listed
    assert "{}.{}".format(*django.VERSION[:2]) in listed, listed
    [requirement] = [
        Requirement(r) for r in project["dependencies"] if Requirement(r).name.lower() == "django"
    ]
    refused = [v for v in listed if not requirement.specifier.contains(f"{v}.0")]
    assert not refused, f"{requirement} refuses the listed Django {refused}"


SETTINGS_TAIL = """

# --- added by the packaging test, as a site's owner would -------------------------
import os

INSTALLED_APPS += ["dispatch", "scheduling"]
if os.environ.get("HOST_DB_NAME"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ["HOST_DB_NAME"],
            "USER": os.environ["HOST_DB_USER"],
            "PASSWORD": os.environ.get("HOST_DB_PASSWORD", ""),
            "HOST": os.environ["HOST_DB_HOST"],
            "PORT": os.environ["HOST_DB_PORT"],
        }
    }
DISPATCH_ENCRYPTION_KEYS = [k for k in os.environ.get("HOST_KEYS", "").split(",") if k]
DISPATCH_CONNECTORS = [p for p in os.environ.get("HOST_CONNECTORS", "").split(",") if p]
DISPATCH_POLL_INTERVAL = 0.5
"""

URLS = """
from django.contrib import admin
from django.contrib.admin import AdminSite
from django.urls import path

from dispatch.admin_site import register

ops = AdminSite(name="ops")
register(ops)

urlpatterns = [path("ops/console/", ops.urls), path("admin/", admin.site.urls)]
"""

SETUP = """
from dispatch.models import Datasource, Job, JobBinding
source = Datasource(name="gen", kind="generate")
source.config = {}
source.save()
sink = Datasource(name="void", kind="null")
sink.config = {}
sink.save()
job = Job.objects.create(name="copy", source_spec={"rows": 25})
JobBinding.objects.create(name="gen-to-void", job=job, source=source, sink=sink)
"""

RESULT = """
from dispatch.models import Run
import sys
run = Run.objects.get()
if run.attempts.count() != 1:  # say why, not just that
    for a in run.attempts.order_by("number"):
        print("attempt", a.number, a.status, a.origin, a.reason, repr(a.error)[:300],
              file=sys.stderr)
    sys.exit(1)
attempt = run.attempts.get()
print(run.status, attempt.rows_written)
"""

PAGES = """
import re
from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import setup_test_environment
from django.urls import reverse
from scheduling.models import Schedule
from dispatch.models import JobBinding
from site_one.urls import ops

setup_test_environment()
Schedule.objects.create(binding=JobBinding.objects.get(), cron="0 * * * *", timezone="UTC",
                        enabled=False)
user = get_user_model().objects.create_superuser("op", "op@example.com", "pw-not-used")
client = Client()
client.force_login(user)
urls = [reverse("ops:index"), reverse("ops:dispatch_overview"),
        reverse("ops:app_list", args=["dispatch"]), reverse("ops:app_list", args=["scheduling"])]
for model, model_admin in ops._registry.items():
    info = model._meta.app_label, model._meta.model_name
    urls += [reverse("ops:%s_%s_changelist" % info), reverse("ops:%s_%s_add" % info)]
    for row in model._default_manager.all()[:2]:
        urls += [reverse("ops:%s_%s_change" % info, args=[row.pk]),
                 reverse("ops:%s_%s_history" % info, args=[row.pk])]
apps = set()
for url in urls:
    assert url.startswith("/ops/console/"), url
    response = client.get(url)
    if url.endswith("/add/") and response.status_code == 403:
        continue
    assert response.status_code in (200, 302), (url, response.status_code)
    if response.status_code == 302:
        assert response["Location"].startswith("/ops/console/"), url
        continue
    body = response.content.decode()
    # Django 5.2 rendered a database default's repr on add pages.
    assert "DatabaseDefault" not in body, url
    wrong = [h for h in re.findall(r'(?:href|action)="(/[^"]*)"', body) if h.startswith("/admin/")]
    assert not wrong, (url, wrong[:3])
    apps.add(url.split("/")[3])
index = client.get(reverse("ops:index")).content.decode()
assert reverse("ops:dispatch_overview_changelist") in index, "no overview entry on the index"
print("PAGES", len(urls), sorted(apps))
"""


@pytest.fixture
def host_database() -> dict[str, str]:
    name = f"{connection.settings_dict['NAME']}_host_site"
    admin_url = test_database_url().rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    s = connection.settings_dict
    yield {
        "HOST_DB_NAME": name,
        "HOST_DB_USER": s["USER"],
        "HOST_DB_PASSWORD": s.get("PASSWORD") or "",
        "HOST_DB_HOST": s["HOST"] or "127.0.0.1",
        "HOST_DB_PORT": str(s["PORT"] or 5432),
    }
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.mark.django_db
def test_a_new_django_site__installs_migrates_runs_and_serves_the_console(
    venv: Path, tmp_path: Path, host_database: dict[str, str]
):
    bindir = venv / "bin"
    run(
        [str(bindir / "django-admin"), "startproject", "site_one", str(tmp_path)],
        cwd=tmp_path,
        env=clean_env(),
    )
    (tmp_path / "site_one" / "settings.py").open("a").write(SETTINGS_TAIL)
    (tmp_path / "site_one" / "urls.py").write_text(URLS)
    python = str(bindir / "python")
    manage = [python, "manage.py"]
    base = clean_env(DJANGO_SETTINGS_MODULE="site_one.settings", PYTHONUNBUFFERED="1")

    # The apps come from the virtualenv, never from the checkout.
    where = run(
        [
            python,
            "-c",
            "import dispatch, sys; print(dispatch.__file__); "
            "import importlib.util as u; print(u.find_spec('tests'), u.find_spec('project'))",
        ],
        cwd=tmp_path,
        env=base,
    ).stdout
    assert str(venv) in where.splitlines()[0] and str(ROOT) not in where
    assert where.splitlines()[1] == "None None"

    # Clear errors: the SQLite database startproject made, then no key, a bad connector.
    sqlite = run([*manage, "check"], cwd=tmp_path, env={**base, "HOST_KEYS": KEY}, ok=False)
    assert sqlite.returncode != 0 and "dispatch.E010" in sqlite.stderr, sqlite.stderr
    pg = {**base, **host_database}
    no_key = run([*manage, "check"], cwd=tmp_path, env=pg, ok=False)
    assert no_key.returncode != 0 and "dispatch.E001" in no_key.stderr
    env = {**pg, "HOST_KEYS": KEY}
    bad = run(
        [*manage, "check"],
        cwd=tmp_path,
        env={**env, "HOST_CONNECTORS": "site_one.connectors.Nope"},
        ok=False,
    )
    assert bad.returncode != 0 and "dispatch.E012" in bad.stderr
    assert "site_one.connectors.Nope" in bad.stderr
    unmigrated = run([*manage, "runworker", "--burst"], cwd=tmp_path, env=env, ok=False, timeout=60)
    assert unmigrated.returncode != 0 and "manage.py migrate" in unmigrated.stderr

    run([*manage, "check"], cwd=tmp_path, env=env)
    run([*manage, "migrate", "--no-input", "-v", "0"], cwd=tmp_path, env=env)
    run([*manage, "makemigrations", "--check", "--dry-run"], cwd=tmp_path, env=env)
    run([*manage, "shell", "--no-imports", "-c", SETUP], cwd=tmp_path, env=env)
    run_id = run([*manage, "trigger", "gen-to-void"], cwd=tmp_path, env=env).stdout.strip()
    assert len(run_id) == 36
    worker = run([*manage, "runworker", "--burst"], cwd=tmp_path, env=env, timeout=60)
    # No LOGGING in a fresh site: the worker logs to stderr anyway, with a start-up line.
    assert "worker started" in worker.stderr and "channel=dispatch_runs" in worker.stderr
    assert f"database={host_database['HOST_DB_HOST']}" in worker.stderr
    assert run(
        [*manage, "shell", "--no-imports", "-c", RESULT], cwd=tmp_path, env=env
    ).stdout.split() == [
        "SUCCEEDED",
        "25",
    ]
    pages = run([*manage, "shell", "--no-imports", "-c", PAGES], cwd=tmp_path, env=env).stdout
    assert "PAGES" in pages and "'dispatch'" in pages and "'scheduling'" in pages, pages


def readme_block(marker: str) -> str:
    """The fenced block right after `<!-- install:MARKER -->` in the README, as written."""
    text = (ROOT / "README.md").read_text()
    head = f"<!-- install:{marker} -->\n```python\n"
    assert head in text, f"the README has no {marker} snippet"
    return text.split(head, 1)[1].split("\n```", 1)[0] + "\n"


def readme_keygen_command() -> str:
    """The README's key-generation line (`python -c "..."`)."""
    text = (ROOT / "README.md").read_text()
    (line,) = [row for row in text.splitlines() if row.startswith('python -c "from cryptography')]
    return line.split('"', 2)[1]


SCHEDULE = """
from dispatch.models import Datasource, Job, JobBinding
from scheduling.models import Schedule
source = Datasource(name="gen", kind="generate")
source.config = {}
source.save()
sink = Datasource(name="void", kind="null")
sink.config = {}
sink.save()
job = Job.objects.create(name="copy", source_spec={"rows": 5})
binding = JobBinding.objects.create(name="every-minute", job=job, source=source, sink=sink)
schedule = Schedule.objects.create(binding=binding, cron="* * * * *", timezone="UTC")
# The current minute's slot, due now (as the minute passing would make it): the worker's
# reconciler fires it on its first pass rather than at the next minute.
from django.db.models.functions import Now, TruncMinute
Schedule.objects.filter(pk=schedule.pk).update(next_fire_at=TruncMinute(Now()))
"""

HEALTH = """
from django.test import Client
from django.test.utils import setup_test_environment
setup_test_environment()
print("HEALTHZ", Client().get("/dispatch/healthz").status_code)
"""


def _runs_python(path: str) -> bool:
    """Whether `path` is a working Python 3.12+ (a pyenv shim of a version that is not
    selected exits non-zero)."""
    try:
        done = subprocess.run(
            [path, "-c", "import sys; assert sys.version_info >= (3, 12)"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return False
    return done.returncode == 0


def _newer_pythons() -> list[str]:
    """A Python 3.12+ other than this one, on PATH or installed by pyenv: Django 6.x needs
    3.12, so a machine that has one also runs the host site on the newest Django pip
    picks there."""
    candidates = [shutil.which(f"python3.{minor}") for minor in range(20, 11, -1)]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    if pyenv.is_dir():
        candidates += sorted(
            (str(p) for p in pyenv.glob("3.*/bin/python3.*") if p.name[-1].isdigit()),
            reverse=True,
        )
    this = os.path.realpath(sys.executable)
    for path in candidates:
        if path and os.path.realpath(path) != this and _runs_python(path):
            return [path]
    return []


# Found once: the parameter of readme_venv and the Python newer_venv_build installs.
NEWER_PYTHON = _newer_pythons()[:1]


@pytest.fixture(scope="session", params=NEWER_PYTHON or ["this-python"])
def readme_venv(
    request: pytest.FixtureRequest, venv: Path, newer_venv_build: Future[Path] | None
) -> Path:
    """A virtualenv of a Python 3.12+ found on the machine (Django 6.x), else the
    session's (this Python)."""
    if newer_venv_build is None:
        return venv
    home = newer_venv_build.result()
    django = run(
        [str(home / "bin" / "python"), "-c", "import django; print(django.VERSION[0])"],
        cwd=home.parent,
        env=clean_env(),
    ).stdout.strip()
    assert int(django) >= 6, f"{request.param} installed Django {django}, not 6.x"
    return home


@pytest.mark.django_db
def test_the_readme_install_section__as_written__makes_a_site_whose_schedules_fire(
    readme_venv: Path, tmp_path: Path, host_database: dict[str, str]
):
    """The README's install section, literally: its key command, its settings and urls
    snippets, `migrate`, then one `runworker` with no flags, and a `* * * * *` schedule
    fires (the worker runs the reconciler by default). On the newest Python the machine
    has (3.12+: Django 6.x), else this one; the console test covers this Python's Django."""
    bindir = readme_venv / "bin"
    python = str(bindir / "python")
    site = tmp_path / "site"
    site.mkdir()
    run(
        [str(bindir / "django-admin"), "startproject", "mysite", str(site)],
        cwd=site,
        env=clean_env(),
    )
    with (site / "mysite" / "settings.py").open("a") as settings_file:
        settings_file.write("\n" + readme_block("settings"))
    with (site / "mysite" / "urls.py").open("a") as urls_file:
        urls_file.write("\n" + readme_block("urls"))
    key = run([python, "-c", readme_keygen_command()], cwd=site, env=clean_env()).stdout.strip()
    base = clean_env(
        PYTHONUNBUFFERED="1",
        PGDATABASE=host_database["HOST_DB_NAME"],
        PGUSER=host_database["HOST_DB_USER"],
        PGPASSWORD=host_database["HOST_DB_PASSWORD"],
        PGHOST=host_database["HOST_DB_HOST"],
        PGPORT=host_database["HOST_DB_PORT"],
    )
    manage = [python, "manage.py"]

    # Without the key the product's own check says so (no KeyError at import).
    no_key = run([*manage, "check"], cwd=site, env=base, ok=False)
    assert no_key.returncode != 0 and "dispatch.E001" in no_key.stderr, no_key.stderr
    assert "KeyError" not in no_key.stderr
    env = {**base, "DISPATCH_ENCRYPTION_KEYS": key}
    run([*manage, "check"], cwd=site, env=env)
    run([*manage, "migrate", "--no-input", "-v", "0"], cwd=site, env=env)
    run([*manage, "shell", "--no-imports", "-c", SCHEDULE], cwd=site, env=env)
    health = run([*manage, "shell", "--no-imports", "-c", HEALTH], cwd=site, env=env).stdout
    assert "HEALTHZ 200" in health, health

    url = (
        f"postgres://{host_database['HOST_DB_USER']}@{host_database['HOST_DB_HOST']}:"
        f"{host_database['HOST_DB_PORT']}/{host_database['HOST_DB_NAME']}"
    )

    def succeeded_scheduled_runs() -> int:
        with psycopg.connect(url, password=host_database["HOST_DB_PASSWORD"] or None) as conn:
            row = conn.execute(
                "SELECT count(*) FROM dispatch_run r JOIN dispatch_jobbinding b"
                " ON b.id = r.binding_id WHERE b.name = 'every-minute'"
                " AND r.status = 'SUCCEEDED' AND r.scheduled_for IS NOT NULL"
            ).fetchone()
        return int(row[0]) if row else 0

    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log_file:
        worker = subprocess.Popen(
            [*manage, "runworker"], cwd=site, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
        try:
            # The current minute's slot is due (SCHEDULE): the first pass fires it.
            wait_until(
                lambda: succeeded_scheduled_runs() >= 1,
                timeout=60,
                interval=0.2,
                message="a run of the every-minute schedule to succeed",
            )
        except AssertionError:
            worker.kill()
            raise AssertionError(log_path.read_text()[-3000:]) from None
        finally:
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(timeout=60)
    assert code == 0, log_path.read_text()[-3000:]
