"""CI runs README's commands verbatim, and the code stays lint-clean."""

import importlib.util
import subprocess
import sys

import pytest

from prefill_bundle import REPO_ROOT


def test_ci_runs_the_readme_commands():
    readme = (REPO_ROOT / "README.md").read_text()
    ci_lines = [
        line
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith((".venv/", "python3 -m venv"))
    ]
    assert len(ci_lines) == 2, ".ci/run should install and test, one line each"
    for line in ci_lines:
        assert line in readme, f".ci/run runs a command README.md does not show: {line}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is a dev extra")
def test_ruff_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", str(REPO_ROOT)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
