"""Secret references of definition files (dispatch.ascode): `env:NAME` and `file:/path`,
never values.

An apply may be asked for over HTTP by whoever holds the apply permission, and a
datasource's secret is sent to the host its config names. Unconfined, `env:SECRET_KEY`
or `file:/etc/shadow` on a datasource pointed at an attacker's server would hand the
site's own secrets out. So the site's settings confine what a reference may name:

- `env:NAME`: NAME must start with `DISPATCH_APPLY_ENV_PREFIX` (default
  `DISPATCH_SECRET_`; an empty prefix turns env references off rather than allowing all),
  and is never one of the site's own secret variables (`SITE_VARIABLES`), whatever the
  prefix; a prefix that covers one of them is refused (system check dispatch.E018);
- `file:/path`: the path's real path (every symbolic link followed) must lie inside one
  of `DISPATCH_APPLY_SECRET_DIRS` (default none: file references are off), none of which
  may be a system directory or another place `dispatch.security.paths` protects, nor lie
  in /etc, /proc, /sys, /dev or /boot (dispatch.E018); the file must be a regular file of
  at most `MAX_SECRET_FILE_BYTES`.

Messages name the reference, never the value.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from dispatch.core import conf
from dispatch.security import limits, paths

SCHEMES = ("env", "file")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Environment variables that hold the site's own secrets (project/settings.py reads
# them): never a datasource's.
SITE_VARIABLES = frozenset(
    {
        "SECRET_KEY",
        "DATABASE_URL",
        "DISPATCH_ENCRYPTION_KEYS",
        "DISPATCH_LISTEN_URL",
        "DISPATCH_METRICS_TOKEN",
        "DISPATCH_ALERT_WEBHOOK_URL",
        "DISPATCH_ALERT_WEBHOOK_SECRET",
        "DISPATCH_ALERT_WEBHOOKS",
    }
)
# What a secrets directory may never be (dispatch.E018). Never inside these system
# trees (paths.SYSTEM_TREES), which hold the system's own secrets and kernel interfaces
# (/proc/self/environ holds SECRET_KEY): a file reference there reads them.
NEVER_INSIDE = ("/etc", "/proc", "/sys", "/dev", "/boot")
# Never one of these roots of other people's data. A directory inside one is fine.
BROAD_DIRS = ("/", "/home", "/var", "/tmp")
# Nor ever one of the protected places of dispatch.security.paths (a system tree, a
# directory Python imports code from, the Python installation, a directory on PATH, the
# home directory): each holds far more than secrets (a checkout's .env, ~/.pgpass). A
# directory inside one is fine (/run/secrets/dispatch, /usr/local/etc/secrets).
_ONLY_SECRETS = "name a directory that holds only secrets"


class RefError(ValueError):
    """A reference that is malformed, not allowed here, or does not resolve."""


@dataclass(frozen=True)
class SecretRef:
    scheme: str
    target: str

    def __str__(self) -> str:
        return f"{self.scheme}:{self.target}"


def looks_like_ref(value: object) -> bool:
    return isinstance(value, str) and value.split(":", 1)[0] in SCHEMES and ":" in value


def parse(value: str) -> SecretRef:
    """The reference `value` spells; raises `RefError` when it is not one."""
    scheme, sep, target = value.partition(":")
    if not sep or scheme not in SCHEMES:
        raise RefError("must be a reference, env:NAME or file:/path (a secret is never a value)")
    if scheme == "env":
        if not _ENV_NAME.match(target):
            raise RefError(f"env:{target[:60]} does not name an environment variable")
    elif not os.path.isabs(target) or "\x00" in target:
        raise RefError("a file: reference needs an absolute path (file:/run/secrets/name)")
    return SecretRef(scheme, target)


def prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot be DISPATCH_APPLY_ENV_PREFIX ("" is allowed: env refs off)."""
    if not prefix:
        return None
    if not _ENV_NAME.match(prefix):
        return "it is not the start of an environment variable's name (letters, digits, _)"
    covered = sorted(v for v in SITE_VARIABLES if v.startswith(prefix))
    if covered:
        return (
            f"it would let definition files read the site's own secrets ({', '.join(covered)}); "
            "give secrets for datasources a prefix of their own, e.g. DISPATCH_SECRET_"
        )
    return None


def dir_problem(path: str) -> str | None:
    """Why `path` cannot be one of DISPATCH_APPLY_SECRET_DIRS."""
    if not os.path.isabs(path):
        return f"{path!r} is not an absolute path"
    real = os.path.realpath(path)
    for root in NEVER_INSIDE:
        if paths.within(real, os.path.realpath(root)):
            return f"{path!r} is (or is inside) {root}: {_ONLY_SECRETS}"
    for root in BROAD_DIRS:
        if real == os.path.realpath(root):
            return f"{path!r} is (or is inside) {root}: {_ONLY_SECRETS}"
    for place in paths.protected():
        if real == place.path:
            return f"{path!r} is {place.what} ({place.path}): {_ONLY_SECRETS}"
    return None


def check_allowed(ref: SecretRef) -> None:
    """Refuse a reference the site's settings do not allow (without reading it)."""
    if ref.scheme == "env":
        prefix = conf.apply_env_prefix()
        if not prefix:
            raise RefError("env: references are off (DISPATCH_APPLY_ENV_PREFIX is empty)")
        if prefix_problem(prefix):
            raise RefError(
                "env: references are off: DISPATCH_APPLY_ENV_PREFIX cannot be used "
                "(system check dispatch.E018)"
            )
        if ref.target in SITE_VARIABLES:
            raise RefError(f"env:{ref.target} holds a secret of the site itself")
        if not ref.target.startswith(prefix):
            raise RefError(
                f"env:{ref.target} is not allowed: the variable's name must start with "
                f"{prefix} (DISPATCH_APPLY_ENV_PREFIX)"
            )
        return
    dirs = [d for d in conf.apply_secret_dirs() if dir_problem(d) is None]
    if not dirs:
        raise RefError(
            "file: references are off: the site allows no directory for them "
            "(DISPATCH_APPLY_SECRET_DIRS; system directories never count)"
        )
    if _inside(os.path.realpath(ref.target), dirs) is None:
        raise RefError(
            f"file:{ref.target} is not allowed: it is not inside a directory the site "
            f"allows for secrets (DISPATCH_APPLY_SECRET_DIRS: {', '.join(dirs)})"
        )


def resolve(ref: SecretRef) -> str:
    """The value `ref` names; raises `RefError` (naming the reference only)."""
    check_allowed(ref)
    if ref.scheme == "env":
        value = os.environ.get(ref.target)
        if value is None:
            raise RefError(f"env:{ref.target} is not set in the environment of the apply")
        if not value:
            raise RefError(f"env:{ref.target} is empty (leave the field out instead)")
        return value
    return _read_file(ref)


def _inside(real: str, dirs: list[str]) -> str | None:
    """The first of `dirs` (resolved) that the real path `real` lies in, never is."""
    for root in dirs:
        base = os.path.realpath(root)
        if real != base and paths.within(real, base):
            return base
    return None


def _read_file(ref: SecretRef) -> str:
    real = os.path.realpath(ref.target)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        # O_NONBLOCK: a FIFO put there opens at once instead of hanging the apply;
        # O_NOFOLLOW: the path was resolved above, a link swapped in since is refused.
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise RefError(f"file:{ref.target} does not exist") from None
    except OSError as exc:
        raise RefError(f"file:{ref.target} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RefError(f"file:{ref.target} is not a regular file")
        if info.st_size > limits.MAX_SECRET_FILE_BYTES:
            raise RefError(
                f"file:{ref.target} is larger than {limits.MAX_SECRET_FILE_BYTES:,} bytes"
            )
        raw = os.read(fd, limits.MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > limits.MAX_SECRET_FILE_BYTES:
        raise RefError(f"file:{ref.target} is larger than {limits.MAX_SECRET_FILE_BYTES:,} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RefError(f"file:{ref.target} is not UTF-8 text") from None
    # One trailing line break is how files end, not part of the secret.
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise RefError(f"file:{ref.target} is empty")
    return text
