"""Logging for the server and its device processes: one line of text, or one JSON object, per record, from every
logger (third-party ones and Python warnings included), under names that say what logs."""

from __future__ import annotations

import importlib
import json
import logging
import os

RENAMED = {"uvicorn.error": "vitserve.server", "uvicorn": "vitserve.server", "py.warnings": "vitserve.warnings"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        entry.update(getattr(record, "fields", {}))  # the access line's fields, as fields
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _Rename(logging.Filter):
    """uvicorn's general messages come from a logger named "uvicorn.error": they say what the server does."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = RENAMED.get(record.name, record.name)
        return True


def configure_logging(log_format: str, level: str) -> None:
    """Route every logger through one handler on stderr, as text or JSON (`log_format`), at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_Rename())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    importlib.import_module("huggingface_hub.utils.logging")  # it adds a handler of its own on import: cleared below

    for logger in logging.Logger.manager.loggerDict.values():  # libraries that print through handlers of their own
        if isinstance(logger, logging.Logger) and logger.handlers:
            logger.handlers.clear()
            logger.propagate = True
    logging.captureWarnings(True)  # warnings.warn (huggingface_hub's among them) as log records, not raw stderr
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # progress bars are not log lines
