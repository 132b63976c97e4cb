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
Every file a block reads (an image it names, a file it opens or uploads) is one of the repository's, and every module
a `local` or `server` python block imports is a runtime dependency of vitserve or installed by a `pip install` the
same doc shows before it. And the error table of docs/api.md names every error code the code can answer."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import STARTUP_S

from vitserve.service.entry.cli import build_parser
from vitserve.service.entry.launch import start_server

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
                line = text[: m.start()].count("\n") + 1
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


@pytest.mark.parametrize(
    "where, code", [(w, c) for w, lang, c, _ in blocks("install") + blocks("serve") if lang == "bash"]
)
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


IMAGE_PATH = re.compile(r"(?<![\w./:~-])[\w./~-]*\w\.(?:jpe?g|png|webp|gif|bmp|tiff?)\b", re.I)  # not in URLs


def files_read(language: str, code: str) -> set[str]:
    """The files a block reads: every image path it names, what its python opens (`open`, `Image.open`) for
    reading, and what its curl uploads (`-F name=@path`, `-d @path`)."""
    paths = set(IMAGE_PATH.findall(code))
    if language == "python":
        for node in ast.walk(ast.parse(code)):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "open"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                mode = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "r"
                if not set(mode) & set("wax"):
                    paths.add(node.args[0].value)
    else:
        paths |= set(re.findall(r"@([\w./~-]+)", code))
    return paths


def test_the_files_blocks_read_are_in_the_repository():
    """What a block reads is shipped, at the path it names from the repository's root (where the snippets run)."""
    missing = [
        f"{where}: {path}"
        for where, language, code, _ in blocks()
        for path in sorted(files_read(language, code))
        if not (ROOT / path).is_file()
    ]
    assert missing == [], "blocks read files the repository does not have: " + ", ".join(missing)


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503): `Pydantic_Core>=2` -> `pydantic-core`."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group()).lower()


def requirements(extras: set[str] = frozenset()) -> set[str]:
    """The names of vitserve's runtime requirements, and of its `extras` (its own extras they name, expanded), from
    the installed vitserve's metadata (CI installs this checkout)."""
    names, pending, seen = set(), set(extras), set()
    declared = importlib.metadata.requires("vitserve") or []
    names |= {_name(r) for r in declared if "extra ==" not in r}
    while pending - seen:
        extra = (pending - seen).pop()
        seen.add(extra)
        for r in declared:
            if re.search(rf"extra == ['\"]{re.escape(extra)}['\"]", r):
                if _name(r) == "vitserve":
                    pending |= set(re.search(r"\[(.*?)\]", r).group(1).split(","))
                else:
                    names.add(_name(r))
    return names


PIP_OPTIONS_WITH_VALUES = {
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--python-version",
}


def pip_installed(code: str) -> set[str]:
    """The distributions the `pip install` commands of a shell block install (`.[extras]` as vitserve's extras)."""
    out = set()
    for line in code.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;|\|", line) if re.search(r"pip3? install", line) else []:
            words = shlex.split(part, comments=True)
            if "install" not in words or not any(w.endswith("pip") for w in words[: words.index("install")]):
                continue
            args = iter(words[words.index("install") + 1 :])
            for word in args:
                if word in PIP_OPTIONS_WITH_VALUES:
                    next(args, None)
                elif word.startswith(".") or word.startswith("/"):  # this checkout, with extras
                    extras = re.search(r"\[(.*?)\]", word)
                    out |= requirements(set(extras.group(1).split(",")) if extras else set())
                elif not word.startswith("-"):
                    out.add(_name(word))
    return out


def imported(code: str) -> set[str]:
    """The top-level modules a python block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_modules_blocks_import_are_installed_as_the_docs_say():
    """A `local` or `server` python block imports the standard library, vitserve and its runtime requirements, or
    what a `pip install` of a shell block before it in the same doc installs (`external` blocks may need more)."""
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for doc in DOCS:
        text, shown = doc.read_text(), set()
        for m in BLOCK.finditer(text):
            kind, language, code = m.group(1), m.group(2), m.group(3)
            if language == "bash":
                shown |= pip_installed(code)
            elif kind in ("local", "server"):
                allowed = requirements() | shown
                for module in sorted(imported(code) - set(sys.stdlib_module_names) - {"vitserve"}):
                    if not {_name(d) for d in distributions.get(module, [])} & allowed:
                        missing.append(f"{doc.name}:{text[: m.start()].count(chr(10)) + 1}: {module}")
    assert missing == [], "blocks import modules neither vitserve requires nor the doc installs first: " + ", ".join(
        missing
    )


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
    flags = ("--model", "tiny-qwen2.5-vl", "--load-format", "dummy")
    proc, url = start_server(*flags, timeout=STARTUP_S, capture_log=True)
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
    sources = [*(ROOT / "vitserve" / "service").rglob("*.py"), ROOT / "vitserve" / "encoder" / "preprocess.py"]
    positions = {"ServiceError": 2, "error_response": 2}  # (status, message, code); domain errors (message, code)
    from vitserve.service.ground import errors

    domain = {c.__name__ for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.EngineError)}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.Assign)
                        and [t.id for t in stmt.targets if isinstance(t, ast.Name)] == ["code"]
                        and isinstance(stmt.value, ast.Constant)
                    ):
                        codes.add(stmt.value.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name, at = node.func.id, positions.get(node.func.id, 1)
                if (
                    name in positions
                    or name in domain
                    or name.endswith(("Rejected", "TooLarge", "Unavailable", "Failed"))
                ):
                    if len(node.args) > at and isinstance(node.args[at], ast.Constant):
                        codes.add(node.args[at].value)
    return codes - {"error", "image_error", "client_disconnected"}  # base classes' placeholders; a 499 has no body


def test_the_error_table_names_every_code():
    table = (ROOT / "docs" / "api.md").read_text().split("## Errors")[1].split("\n## ")[0]
    codes = error_codes()
    assert {"invalid_base64", "queue_full", "device_lost", "invalid_api_key", "http_error"} <= codes  # it reads
    missing = sorted(code for code in codes if f"`{code}`" not in table)
    assert missing == [], f"docs/api.md's error table leaves out {missing}"
