"""Settings the benchmarks read from the environment (see each file's docstring)."""
import os

import pytest


def env_int(name, default):
    """``int($name)``, or ``default`` when unset; a clear usage error when not a number."""
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise pytest.UsageError(f"{name} must be an integer, got {value!r}") from None
