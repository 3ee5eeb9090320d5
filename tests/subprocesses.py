"""Running Python in a fresh process against this checkout's packages (import boundaries, environment switches that
must be set before import)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOTS = [os.path.join(os.path.dirname(__file__), "..", "packages", p, "src") for p in ("core", "torch_ops", "jax_ops")]


def run_python(*args: str, code: str | None = None, **env: str | None) -> subprocess.CompletedProcess:
    """python [-c dedented code] args, with env overrides (None removes a variable)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(ROOTS + [os.environ.get("PYTHONPATH", "")])}
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    command = [sys.executable] + (["-c", textwrap.dedent(code)] if code else []) + list(args)
    return subprocess.run(command, capture_output=True, text=True, env=environ)
