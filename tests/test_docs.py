"""The docs document what a user can meet: every flag and env var (docs/configuration.md holds flag_table()'s output),
CI runs the README's test command, and the README's links and cited result files exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from vitserve.service.ground.flags import ENV_PREFIX, flag_table, settings_fields

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
    for f in settings_fields():
        for name in (f.name, *f.metadata.get("aliases", ())):
            assert f"`--{name.replace('_', '-')}`" in doc, name
            assert f"`{ENV_PREFIX}{name.upper()}`" in doc, name


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = _between(readme, "<!-- test-command -->", "<!-- /test-command -->")
    command = [line for line in block.splitlines() if line and not line.startswith("```")]
    assert len(command) == 1 and "pytest" in command[0]
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_install_lines_take_torchs_cpu_build_in_range():
    """Every `pip install` of torch in the README (the test command CI runs, the Quickstart's CPU install) takes the
    CPU build from PyTorch's CPU index, at a version pyproject's range allows: PyPI's torch (a bare `torch`, or
    `torch==2.13.0`) is the CUDA build, about 5 GB, and an unbounded one can leave the range (the project's install
    would then replace it with PyPI's)."""
    low, high = re.search(r'"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text()).groups()
    code = "".join(re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S))
    commands = [
        part for line in code.splitlines() for part in re.split(r"&&|;", line.split("  #")[0]) if "pip install" in part
    ]
    torch_installs = [
        words for words in map(shlex.split, commands) if any(re.match(r"torch(?![\w-])", w) for w in words)
    ]
    assert len(torch_installs) >= 2  # the test command and the Quickstart
    for words in torch_installs:
        (spec,) = [w for w in words if re.match(r"torch(?![\w-])", w)]
        index = words[words.index("--index-url") + 1] if "--index-url" in words else None
        assert index == "https://download.pytorch.org/whl/cpu", words
        pinned = re.fullmatch(r"torch==([\d.]+)\+cpu", spec)
        assert spec == f"torch>={low},<{high}" or pinned and _version(low) <= _version(pinned[1]) < _version(high), spec


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
