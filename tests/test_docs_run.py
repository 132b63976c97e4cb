"""The docs run as written. Every bash and python block of README.md and docs/*.md carries a `<!-- run: KIND -->`
marker, and is checked as its kind says:
- `local`: run as is (in a scratch directory holding examples/), and must succeed;
- `server`: run against a real `vitserve serve` of the tiny model (its port in place of 8000), and must succeed
  without an error answer;
- `install` (installs, Docker) and `serve` (starts a server for good): shell syntax checked, and every `vitserve`
  command line in it parses;
- `external`: needs what CI has not (vLLM, SGLang, a real checkpoint, a GPU): bash syntax-checked, python
  compiled;
- `ci`: the test command, which CI itself runs.
And the error table of docs/api.md names every error code the code can answer."""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vitserve.service.cli import build_parser
from vitserve.service.launch import start_server

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- run: (\w+) -->\n)?(?:<!-- [^\n]* -->\n)*```(bash|python)\n(.*?)```", re.S)
KINDS = {"local", "server", "install", "serve", "external", "ci"}


def blocks(kind: str | None = None) -> list[tuple[str, str, str]]:
    """(where, language, code) of every block of `kind` (None: all, kind unchecked)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            if kind is None or m.group(1) == kind:
                line = text[:m.start()].count("\n") + 1
                out.append((f"{doc.name}:{line}", m.group(2), m.group(3), m.group(1)))
    return out


def test_every_block_says_how_it_runs():
    unmarked = [where for where, _, _, kind in blocks() if kind not in KINDS]
    assert unmarked == [], "add a <!-- run: KIND --> line before these blocks: " + ", ".join(unmarked)


def vitserve_commands(code: str) -> list[list[str]]:
    """The argument lists of the `vitserve ...` commands in a shell block (continued lines joined)."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;|\|", line.split("  #")[0]):
            words = shlex.split(part, comments=True)
            if words and words[0].endswith("vitserve"):
                out.append(words[1:])
    return out


@pytest.mark.parametrize("where, code", [(w, c) for w, lang, c, _ in blocks("install") + blocks("serve")
                                         if lang == "bash"])
def test_install_and_serve_blocks_parse(where, code):
    assert subprocess.run(["bash", "-n", "-c", code]).returncode == 0, where
    for args in vitserve_commands(code):
        if args[:1] != ["--help"]:
            build_parser().parse_args(args)  # exits (SystemExit) on a flag that does not exist


@pytest.mark.parametrize("where, language, code", [(w, lang, c) for w, lang, c, _ in blocks("external")])
def test_external_blocks_are_well_formed(where, language, code):
    if language == "bash":
        assert subprocess.run(["bash", "-n", "-c", code]).returncode == 0, where
    else:
        compile(code, where, "exec")


def scratch(tmp_path: Path) -> dict:
    """A working directory like the repository's for the snippets (examples/ in it), and an environment whose
    `vitserve` is this interpreter's."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    return os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}


def run(language: str, code: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    command = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("where, language, code", [(w, lang, c) for w, lang, c, _ in blocks("local")])
def test_local_blocks_run(where, language, code, tmp_path):
    result = run(language, code, tmp_path, scratch(tmp_path))
    assert result.returncode == 0, f"{where}:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--model", "tiny-qwen2.5-vl", "--load-format", "dummy", timeout=60, capture_log=True)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("where, language, code", [(w, lang, c) for w, lang, c, _ in blocks("server")])
def test_server_blocks_run(where, language, code, server, tmp_path):
    if language == "bash" and "curl" in code and shutil.which("curl") is None:
        pytest.skip("no curl here")
    code = code.replace("http://localhost:8000", server).replace("localhost:8000", server.removeprefix("http://"))
    result = run(language, code, tmp_path, scratch(tmp_path))
    assert result.returncode == 0, f"{where}:\n{result.stdout}\n{result.stderr}"
    assert '"error"' not in result.stdout, f"{where} got an error answer:\n{result.stdout[:2000]}"


def error_codes() -> set[str]:
    """Every `code` the service can put in an error answer, read from the source: the domain errors' and image
    errors' class attributes, and the code argument of every error it raises or renders."""
    codes = set()
    sources = [*(ROOT / "service").glob("*.py"), ROOT / "encoder" / "preprocess.py"]
    positions = {"ServiceError": 2, "error_response": 2}  # (status, message, code); domain errors (message, code)
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and [t.id for t in stmt.targets if isinstance(t, ast.Name)] == \
                            ["code"] and isinstance(stmt.value, ast.Constant):
                        codes.add(stmt.value.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name, at = node.func.id, positions.get(node.func.id, 1)
                if name in positions or name.endswith(("Rejected", "TooLarge", "Unavailable", "Failed")):
                    if len(node.args) > at and isinstance(node.args[at], ast.Constant):
                        codes.add(node.args[at].value)
    return codes - {"error", "image_error", "client_disconnected"}  # base classes' placeholders; a 499 has no body


def test_the_error_table_names_every_code():
    table = (ROOT / "docs" / "api.md").read_text().split("## Errors")[1].split("\n## ")[0]
    codes = error_codes()
    assert {"invalid_base64", "queue_full", "device_lost", "invalid_api_key", "http_error"} <= codes  # it reads
    missing = sorted(code for code in codes if f"`{code}`" not in table)
    assert missing == [], f"docs/api.md's error table leaves out {missing}"
