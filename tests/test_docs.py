"""The README documents what a user can meet: every flag and env var, and CI runs the README's test command."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from service.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[1]


def test_every_flag_and_env_var_is_documented():
    readme = (ROOT / "README.md").read_text()
    for f in fields(Settings):
        assert f"`--{f.name.replace('_', '-')}`" in readme, f.name
        assert f"`{ENV_PREFIX}{f.name.upper()}`" in readme, f.name


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    command = [line for line in block.splitlines() if line and not line.startswith("```")]
    assert len(command) == 1 and "pytest" in command[0]
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()
