"""Logging for the server, `vitserve encode` and the device processes: one line of text, or one JSON object, per
record, from every logger (third-party ones and Python warnings included), under names that say what logs; the
library's progress records (encoder.progress) as a bar on a terminal, else as a few lines."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import sys
import time

RENAMED = {"uvicorn.error": "vitserve.server", "uvicorn": "vitserve.server", "py.warnings": "vitserve.warnings"}
LINE_INTERVAL = 5.0  # seconds between two lines of one step's progress, when not drawn as a bar
BAR_WIDTH = 24


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))  # the access line's fields, as fields
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _Rename(logging.Filter):
    """uvicorn's general messages come from a logger named "uvicorn.error": they say what the server does. In a
    device process, every name says which device's (`vitserve.runner[cuda:1]`)."""

    def __init__(self, source: str | None = None):
        super().__init__()
        self.suffix = f"[{source}]" if source else ""

    def filter(self, record: logging.LogRecord) -> bool:
        name = RENAMED.get(record.name, record.name)
        record.name = name if name.endswith(self.suffix) else name + self.suffix
        return True


class ProgressHandler(logging.StreamHandler):
    """Records as lines. Those with `progress = (step, done, total)` (encoder.progress), where `bar` (a terminal):
    a bar and the message, redrawn in place on the last line until the step's last record, written as the line it
    is; elsewhere, a step's last line and at most one every LINE_INTERVAL seconds before it (a step that ends
    sooner is one line)."""

    def __init__(self, stream=None, bar: bool = False):
        super().__init__(stream)
        self.bar, self.drawn = bar, False
        self.steps: dict[int, float] = {}  # step -> when it started, or wrote its last line

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if self.drawn:  # whatever comes next takes the bar's line (a step's next record draws it again below)
            self.stream.write("\r\033[K")
            self.drawn = False
        if progress is None:
            return super().emit(record)
        step, done, total = progress
        if done >= total:
            self.steps.pop(step, None)
            return super().emit(record)
        if self.bar:
            try:
                filled = BAR_WIDTH * done // total
                text = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {record.getMessage()}"
                self.stream.write(text[: shutil.get_terminal_size().columns - 1])
                self.drawn = True
                self.flush()
            except Exception:
                self.handleError(record)
            return
        now = time.monotonic()
        if now - self.steps.setdefault(step, now) >= LINE_INTERVAL:
            self.steps[step] = now
            super().emit(record)


def attention_text(kinds: dict[str, str]) -> str:
    """A runner's attention backends (its stats' `attention`: layer kind -> backend) in words: `sdpa`, or `fa4
    (full), flash (window)` where the kinds differ."""
    if len(set(kinds.values())) <= 1:
        return next(iter(kinds.values()), "none")
    return ", ".join(f"{backend} ({kind})" for kind, backend in kinds.items())


def configure_logging(log_format: str, level: str, bar: bool | None = None, source: str | None = None) -> None:
    """Route every logger through one handler on stderr, as text or JSON (`log_format`), at `level`. `bar`: draw
    progress as a bar (default: in text, where stderr is a terminal); `source`: the device a device process serves,
    added to every logger name."""
    if bar is None:
        bar = log_format == "text" and sys.stderr.isatty()
    handler = ProgressHandler(bar=bar and log_format == "text")
    handler.setFormatter(
        JsonFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    handler.addFilter(_Rename(source))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    importlib.import_module("huggingface_hub.utils.logging")  # it adds a handler of its own on import: cleared below

    for logger in logging.Logger.manager.loggerDict.values():  # libraries that print through handlers of their own
        if isinstance(logger, logging.Logger) and logger.handlers:
            logger.handlers.clear()
            logger.propagate = True
    logging.captureWarnings(True)  # warnings.warn (huggingface_hub's among them) as log records, not raw stderr
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # their bars are not log lines
