"""Errors the CLI reports as a one-line message (no traceback)."""


class StageError(RuntimeError):
    """A stage cannot run with this configuration or these inputs."""
