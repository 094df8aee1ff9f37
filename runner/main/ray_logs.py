"""Ray's warnings in one line, in every process of a Ray run (the hook Ray runs as each worker
starts, and the driver).

Ray logs some transient trouble as a warning with its traceback: Train's controller, when the
autoscaling coordinator does not answer within 5 s on a busy machine, prints 20 lines of
`GetTimeoutError` and says that it is "safe to ignore". A user reading the run's output then sees
a traceback beside runner's own one-paragraph error. Here such a warning keeps its message and
gains the exception's one-line summary; errors keep their whole traceback.
"""

from __future__ import annotations

import logging
from typing import Any

HOOK = f"{__name__}.one_line_warnings"  # runtime_env={"worker_process_setup_hook": HOOK}
_MARK = "_runner_one_line_warnings"


def one_line_warnings() -> None:
    """Install the record factory that folds a `ray.*` warning's traceback into its message (idempotent)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, _MARK, False):
        return

    def make_record(name: str, level: int, pathname: str, lineno: int, msg: Any, args: Any, exc_info: Any,
                    *rest: Any, **kwargs: Any) -> logging.LogRecord:
        if exc_info and level == logging.WARNING and (name == "ray" or name.startswith("ray.")):
            message = logging.LogRecord(name, level, pathname, lineno, msg, args, None).getMessage()
            error = exc_info[1] if isinstance(exc_info, tuple) else None
            summary = (str(error).strip().splitlines() or [""])[0] if error is not None else ""
            msg, args, exc_info = f"{message} ({type(error).__name__}: {summary})" if error else message, None, None
        return previous(name, level, pathname, lineno, msg, args, exc_info, *rest, **kwargs)

    setattr(make_record, _MARK, True)
    logging.setLogRecordFactory(make_record)
