"""Settings for the test suite: the site's settings with fixed test keys.

DATABASE_URL comes from the environment (`make test` sets it). The encryption keys are
throwaway keys that exist only for tests.
"""

from __future__ import annotations

import getpass
import os
import tempfile

os.environ.setdefault("SECRET_KEY", "test-only-secret-key")
os.environ.setdefault(
    "DISPATCH_ENCRYPTION_KEYS",
    "7tLtvrDaR4N3B7yWAnMGz7CVGRHhKK0mFmGiZ1cxjbs=",
)
os.environ.setdefault("DISPATCH_POLL_INTERVAL", "0.5")
os.environ.setdefault("DISPATCH_RECOVERY_INTERVAL", "1")
os.environ.setdefault("DISPATCH_IDLE_HEARTBEAT_SECONDS", "1")
os.environ.setdefault("DISPATCH_SHUTDOWN_GRACE_SECONDS", "5")


# CSV datasources are off without this: the tests' files live under pytest's temporary
# directories (tmp_path, under <tmp>/pytest-of-<user>), and worker subprocesses inherit the
# variable. Not the whole temporary directory: a checkout under it is on sys.path, and a
# directory that contains a sys.path entry is refused (docs/security.md, "CSV files").
def _pytest_temp_root() -> str:
    try:
        user = getpass.getuser()
    except (ImportError, KeyError, OSError):
        user = "unknown"  # pytest's own fallback for its temporary root
    root = os.path.join(tempfile.gettempdir(), f"pytest-of-{user}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    return root


os.environ.setdefault("DISPATCH_CSV_BASE_DIRS", _pytest_temp_root())
os.environ.setdefault("DISPATCH_PARQUET_BASE_DIRS", _pytest_temp_root())

from project.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGGING["loggers"]["dispatch"]["level"] = "DEBUG"  # type: ignore[index]  # noqa: F405
# The test server's only role is a superuser; the least-privilege check of query
# sources is tested with a role of its own (tests/test_security_query_permission.py).
DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE = False
