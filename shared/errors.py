"""Named exceptions of the project, flat as in rq: every failure a caller may handle has a name.

A stop request is a flag (``shared.lifecycle.StopFlag``), never an exception; the only broad
``except`` in a service is its consumer loop's poison guard.
"""

from __future__ import annotations


class DressageError(Exception):
    """Base of every project-specific error."""


class ConfigError(DressageError):
    """A configuration value is missing or out of range; the message names the key and the range."""


class MalformedEntry(DressageError):
    """A stream entry or body that cannot be decoded or fails its schema; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnsupportedSchema(MalformedEntry):
    """An entry of an older contract that this version cannot take over (dead-letter reason
    ``unsupported_schema``, original bytes kept; docs/streams.md, schema v1)."""


class VersionRegression(DressageError):
    """A weight version was published that is not newer than the latest one."""


class InvalidSample(ValueError, DressageError):
    """A sample violates the wire contract (e.g. a non-integer ``segment_index``)."""


class UnknownTask(DressageError):
    """A task name that no plugin provides."""


class RedisAuthFailed(DressageError):
    """Redis refused the credentials (wrong/missing password, unknown or disabled ACL user): retrying cannot help."""


class RedisUnavailable(DressageError):
    """Redis did not answer within the time allowed at start."""
