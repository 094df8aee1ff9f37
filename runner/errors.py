"""User-facing errors: one clear paragraph, exit code 2, no traceback."""

from __future__ import annotations

USAGE_EXIT_CODE = 2


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
