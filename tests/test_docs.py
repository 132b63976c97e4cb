"""The docs document what a user can meet: every flag and env var (docs/configuration.md holds flag_table()'s output),
CI runs the README's test command, and the README's links and cited result files exist."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from vitserve.service.settings import ENV_PREFIX, Settings, flag_table

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"


def _between(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1 and text.count(end) == 1, (start, end)
    return text.split(start)[1].split(end)[0]


def test_the_flag_table_is_flag_table():
    table = _between(CONFIGURATION.read_text(), "<!-- flags -->\n", "\n<!-- /flags -->")
    assert table == flag_table(), "regenerate docs/configuration.md's table from service.settings.flag_table()"


def test_every_flag_and_env_var_is_documented():
    doc = CONFIGURATION.read_text()
    for f in fields(Settings):
        for name in (f.name, *f.metadata.get("aliases", ())):
            assert f"`--{name.replace('_', '-')}`" in doc, name
            assert f"`{ENV_PREFIX}{name.upper()}`" in doc, name


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = _between(readme, "<!-- test-command -->", "<!-- /test-command -->")
    command = [line for line in block.splitlines() if line and not line.startswith("```")]
    assert len(command) == 1 and "pytest" in command[0]
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_resolve():
    for doc in _docs():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"


def test_cited_result_files_exist():
    results = ROOT / "bench" / "results"
    for doc in _docs():
        for name in set(re.findall(r"[\w.-]+\.(?:json|txt|png)", doc.read_text())):
            if "h200" in name or name.startswith("soak-"):  # a result file's name
                assert (results / name).exists(), f"{doc.name} cites {name}"
