"""Fixtures of the definition-file tests (helpers: tests/support/ascode.py)."""

from tests.support.ascode import secret_env, write

__all__ = ["secret_env", "write"]
