"""Deployment: `check --deploy` can be made clean from the environment alone; datasource
views hide POST values from error reports; `make run` puts no password on a command line."""

from __future__ import annotations

import inspect
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse

from tests.support.factories import DatasourceFactory
from tests.support.processes import ROOT, test_database_url


def check_deploy(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check", "--deploy", "--fail-level", "ERROR"],
        env={
            **base,
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "DATABASE_URL": test_database_url(),
            "DEBUG": "false",
            "SECRET_KEY": secrets.token_urlsafe(50),
            "DISPATCH_ENCRYPTION_KEYS": os.environ["DISPATCH_ENCRYPTION_KEYS"],
            "ALLOWED_HOSTS": "dispatch.example.com",
            **env,
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_check_deploy__clean_with_https_from_the_environment():
    plain = check_deploy()
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in plain
    clean = check_deploy(
        HTTPS="true",
        CSRF_TRUSTED_ORIGINS="https://dispatch.example.com",
        SECURE_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO,https",
        # Preloading is a commitment the operator makes; off unless asked for.
        SECURE_HSTS_PRELOAD="true",
    )
    assert "System check identified no issues" in clean, clean


@pytest.mark.django_db
def test_datasource_views__post_values_are_hidden_from_error_reports(admin_client: Client):
    ds = DatasourceFactory()
    for url in (
        reverse("admin:dispatch_datasource_add"),
        reverse("admin:dispatch_datasource_change", args=[ds.pk]),
        reverse("admin:dispatch_datasource_changelist"),
    ):
        response = admin_client.post(url, {"config__password": "pw"})
        assert response.wsgi_request.sensitive_post_parameters == "__ALL__", url


def test_make_run__the_demo_password_goes_by_file_not_on_the_command_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    from project import dev

    monkeypatch.setattr(dev, "ROOT", tmp_path)
    path = dev.demo_password_file()
    assert len(path.read_text()) >= 12 and path.stat().st_mode & 0o077 == 0
    assert dev.demo_password_file().read_text() == path.read_text()  # generated once
    run = inspect.getsource(dev.cmd_run)
    assert "password_file=demo_password_file()" in run
    seed = inspect.getsource(dev.seed_demo)
    assert '"--admin-password-file",\n        str(password_file),' in seed
    for source in (run, seed):
        assert '--admin-password"' not in source and "read_text" not in source
