"""The one error type hp_tool raises for bad input: it names the key, the value and the fix."""


class ConfigError(ValueError):
    """Bad user input, reported before any job is submitted or any result file is written."""

    def __init__(self, key: str, value: object, problem: str, fix: str):
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        super().__init__(f"{key}={value!r}: {problem}. Fix: {fix}")


def require(ok: bool, key: str, value: object, problem: str, fix: str) -> None:
    """Raise ConfigError(key, value, problem, fix) unless ``ok``."""
    if not ok:
        raise ConfigError(key, value, problem, fix)
