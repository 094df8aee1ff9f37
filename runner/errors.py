"""User-facing errors: one clear paragraph, exit code 2, no traceback."""

from __future__ import annotations

from runner.exits import USAGE_EXIT_CODE


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, wrong checkpoint).

    The message is shown as-is, without a traceback; it should name the key, the value
    and the fix.
    """

    exit_code: int = USAGE_EXIT_CODE


class ConfigError(UserError):
    """An invalid value in the job spec."""

    def __init__(self, key: str, value: object, problem: str, fix: str) -> None:
        self.key, self.value = key, value
        super().__init__(f"Invalid config `{key}={value!r}`: {problem} Fix: {fix}")


def first_line(err: BaseException, limit: int = 400) -> str:
    """The first non-empty line of an error (libraries put pages of detail after it), else its
    type's name; for quoting inside a one-paragraph message."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:limit]
