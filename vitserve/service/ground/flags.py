"""The flags and VITSERVE_* variables, generated from the settings' groups: one kebab-case flag and one variable
per field (plus its old names, kept as aliases), in --help and docs/configuration.md grouped as the settings are;
sizes with units; one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from fractions import Fraction
from typing import Any

from ...encoder.config import BUILTIN_CONFIGS
from .settings import GROUP_TYPES, Settings

ENV_PREFIX = "VITSERVE_"
# the groups of `vitserve serve --help` and of docs/configuration.md's table, in their order
GROUPS = tuple(group.TITLE for group in GROUP_TYPES.values())


def settings_fields() -> list[dataclasses.Field]:
    """Every field of every group, in the groups' order."""
    return [f for group in GROUP_TYPES.values() for f in dataclasses.fields(group)]


class Parser(argparse.ArgumentParser):
    """Errors as one line, `<prog>: <what is wrong>`, with exit status 2. A bad VITSERVE_* variable (add_arguments
    records it) is one too, reported before any argument is read, `--help` included. Flags are never abbreviated
    (`--mod` is not `--model`), and an unknown one gets the closest known one suggested."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self.env_errors: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        if self.env_errors:
            self.error(self.env_errors[0])
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            flags = [a.split("=")[0] for a in extras if a.startswith("--")]
            known = [o for o in self._option_string_actions if o.startswith("--")]
            match = next((m[0] for f in flags if (m := difflib.get_close_matches(f, known, n=1))), None)
            self.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {match}?" if match else ""))
        return namespace, extras

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.I)
# byte counts: IEC units are powers of 1024 (Kubernetes' Ki, Mi, Gi too), SI units powers of 1000; a bare K, M or G
# (1000 to Kubernetes, 1024 to Docker) is refused as ambiguous
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    **{f"{p}{b}": 2 ** (10 * (i + 1)) for i, p in enumerate("kmgt") for b in ("i", "ib")},
}


def parse_size(text: str) -> int:
    """A byte count: a plain integer, or a number and a unit (`512KiB`, `32MiB`, `4GiB`, `1.5GB`; GB is 10**9,
    GiB 2**30; any case), rounded down to a whole byte."""
    m = SIZE.fullmatch(text.strip())
    if not m or m[2].lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (bytes, or with a unit: 512KiB, 32MiB, 4GiB; KB, MB, GB are powers of 1000)"
        )
    return int(Fraction(m[1]) * SIZE_UNITS[m[2].lower()])


def format_size(n: int) -> str:
    """A byte count as parse_size reads it back: in the largest IEC unit that holds it whole (`32MiB`), else bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % SIZE_UNITS[unit.lower()] == 0:
            return f"{n // SIZE_UNITS[unit.lower()]}{unit}"
    return str(n)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _kind(f) -> type:
    """The field's value type: bool, int, float or str (str for `str | None` fields)."""
    kind = str(f.type)
    return next((t for t in (bool, int, float) if t.__name__ in kind), str)


def _convert(f):
    """What reads the field's flag and variable: parse_size for sizes, _parse_bool for booleans, else its type."""
    kind = _kind(f)
    return parse_size if f.metadata["size"] else _parse_bool if kind is bool else kind


def _default(f) -> str | None:
    """The default as a user writes it (sizes in units, booleans lowercase); None where there is none to show."""
    if f.default is None:
        return None
    if f.metadata["size"]:
        return format_size(f.default)
    return str(f.default).lower() if isinstance(f.default, bool) else str(f.default)


def _metavar(f) -> str:
    """The value as --help and the table show it: the choices, or what kind of value it is."""
    if f.metadata["choices"]:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    kind = _kind(f)
    return f.metadata["metavar"] or (
        "SIZE"
        if f.metadata["size"]
        else "BOOL"
        if kind is bool
        else "N"
        if kind is int
        else "X"
        if kind is float
        else "TEXT"
    )


def _env_value(f):
    """VITSERVE_<FIELD> (or an alias's variable) as (variable, text) when set, else None."""
    for name in (f.name, *f.metadata["aliases"]):
        if ENV_PREFIX + name.upper() in os.environ:
            return ENV_PREFIX + name.upper(), os.environ[ENV_PREFIX + name.upper()]
    return None


def builtin_names() -> str:
    """The built-in model names, for --help: every Qwen3-VL `-Instruct` is there as `-Thinking` too."""
    names = [n for n in BUILTIN_CONFIGS if not n.endswith("-Thinking")]
    return ", ".join(names) + " (each Qwen3-VL -Instruct also as -Thinking)"


def add_arguments(parser: Parser, encode: bool = False) -> None:
    """One flag per field (plus its old names, kept as aliases), in GROUPS; `encode`: only the fields `vitserve
    encode` reads. A flag's default is its variable's value, converted here: a bad one is recorded on the parser."""
    for group in GROUP_TYPES.values():
        shown = [f for f in dataclasses.fields(group) if not encode or f.metadata["encode"]]
        if not shown:
            continue
        arguments = parser.add_argument_group(group.TITLE)
        for f in shown:
            convert, default, env = _convert(f), f.default, _env_value(f)
            if env is not None:
                try:
                    default = convert(env[1])
                except (ValueError, argparse.ArgumentTypeError) as e:
                    reason = (
                        str(e)
                        if isinstance(e, argparse.ArgumentTypeError)
                        else f"invalid {_kind(f).__name__} value: {env[1]!r}"
                    )
                    parser.env_errors.append(f"{env[0]}: {reason}")
            shown_default = (
                "required" if f.name == "model" else None if _default(f) is None else f"default {_default(f)}"
            )
            names = [_flag(f.name), *map(_flag, f.metadata["aliases"])]
            common: dict[str, Any] = dict(
                dest=f.name,
                default=default,
                type=convert,
                metavar=_metavar(f),
                help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}"
                f"{'; ' + shown_default if shown_default else ''}]",
            )
            optional_value: dict[str, Any] = dict(nargs="?", const=True) if _kind(f) is bool else {}
            arguments.add_argument(*names, **common, **optional_value)


def from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags; a field the parser lacks (one `encode` does not read) keeps its default."""
    return Settings.of(**{f.name: getattr(args, f.name) for f in settings_fields() if hasattr(args, f.name)})


def flag_table() -> str:
    """Every flag as Markdown tables, one per group (docs/configuration.md holds them; a test keeps the two equal)."""
    out = []
    for group in GROUP_TYPES.values():
        out += [
            "",
            f"**{group.TITLE}**",
            "",
            "| flag | value | env var | default | `encode` | meaning |",
            "|---|---|---|---|---|---|",
        ]
        for f in dataclasses.fields(group):
            aliases = "".join(f" (or `{_flag(a)}`)" for a in f.metadata["aliases"])
            default = "(required)" if f.name == "model" else f"`{_default(f)}`" if _default(f) is not None else "–"
            out.append(
                f"| `{_flag(f.name)}`{aliases} | `{_metavar(f)}` | `{ENV_PREFIX}{f.name.upper()}` | "
                f"{default} | {'yes' if f.metadata['encode'] else ''} | {f.metadata['help']} |"
            )
    return "\n".join(out[1:])
