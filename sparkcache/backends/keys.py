"""Object keys: what a valid key looks like, and the temp-file names derived from it.

A key is a relative, slash-separated name such as
``objects/m-0123abcd/ab/ab12...-9f3c.r0.safetensors``.  The store builds every key
from digests, integers and random nonces, so the grammar can be strict: anything
outside it is a bug or an attack, never a user's legitimate file name.  The grammar
is chosen so that a key means the same file on every backend (local disk, object
stores) and can never climb out of the store root:

* 1..1024 characters, 1..16 segments separated by ``/``;
* every segment matches ``[A-Za-z0-9_][A-Za-z0-9._-]*`` -- so no empty segment
  (no leading, trailing or doubled ``/``), no ``.`` or ``..``, no hidden files, no
  backslash, NUL, space or non-ASCII character.

Writers publish through a temp object in the same folder, named
``<key>.tmp.<pid>-<start>.<8 hex>``.  The pid and the process's start time let a
checker tell a live writer's temp file from a dead one's, even once the pid was
reused (``<key>.tmp.<pid>.<8 hex>``, without the start time, is still
recognised); the random part keeps two writers in one process apart.
"""

from __future__ import annotations

import os
import re
import secrets

from sparkcache.errors import UnsafeName
from sparkcache.holders import start_time

__all__ = [
    "KEY_SEGMENT_PATTERN",
    "MAX_KEY_CHARS",
    "MAX_KEY_SEGMENTS",
    "TEMP_SUFFIX_PATTERN",
    "is_temp_key",
    "temp_key",
    "temp_key_writer",
    "validate_key",
]

MAX_KEY_CHARS = 1024
"""Longest key accepted (characters; keys are ASCII so also bytes)."""

MAX_KEY_SEGMENTS = 16
"""Most ``/``-separated segments in one key."""

KEY_SEGMENT_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._-]*"
"""Grammar of one segment.  ASCII only: ``re`` ranges are literal code points."""

TEMP_SUFFIX_PATTERN = r"\.tmp\.(?P<pid>[0-9]{1,10})(?:-(?P<start>[0-9]{1,20}))?\.[0-9a-f]{8}"
"""Suffix :func:`temp_key` appends; groups ``pid`` and ``start`` name the writer."""

_SEGMENT_RE = re.compile(KEY_SEGMENT_PATTERN)
_TEMP_RE = re.compile(r".+" + TEMP_SUFFIX_PATTERN)

_KEY_HELP = (
    f"a key is 1..{MAX_KEY_CHARS} characters of 1..{MAX_KEY_SEGMENTS} '/'-separated "
    "segments, each made of letters, digits, '_', '-' and '.', not starting with '.' "
    "or '-' (for example 'objects/m-0123abcd/ab/ab12-9f3c.r0.safetensors')"
)


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid object key, else raise.

    Raises :class:`~sparkcache.errors.UnsafeName` whose message says what a valid key
    looks like.  Every backend method calls this before touching storage, so a key
    that passes can be joined under a root without further escaping.
    """
    if not isinstance(key, str):
        raise UnsafeName(f"object key must be a str, not {type(key).__name__}: {_KEY_HELP}")
    if not key:
        raise UnsafeName(f"object key is empty: {_KEY_HELP}")
    if len(key) > MAX_KEY_CHARS:
        raise UnsafeName(f"object key is {len(key)} characters long: {_KEY_HELP}")
    segments = key.split("/")
    if len(segments) > MAX_KEY_SEGMENTS:
        raise UnsafeName(f"object key has {len(segments)} segments: {_KEY_HELP}")
    for segment in segments:
        if not _SEGMENT_RE.fullmatch(segment):
            raise UnsafeName(
                f"object key {_shorten(key)!r} has an invalid segment "
                f"{_shorten(segment)!r}: {_KEY_HELP}"
            )
    return key


def temp_key(key: str) -> str:
    """Return a fresh temp key ``<key>.tmp.<pid>-<start>.<8 hex>`` beside ``key``.

    Same folder, so a rename publishes it atomically on local disks.  The result is a
    valid key itself; a ``key`` too long to take the suffix raises
    :class:`~sparkcache.errors.UnsafeName`.
    """
    validate_key(key)
    pid = os.getpid()
    started = start_time(pid)
    writer = f"{pid}-{started}" if started.isdigit() else str(pid)
    candidate = f"{key}.tmp.{writer}.{secrets.token_hex(4)}"
    if len(candidate) > MAX_KEY_CHARS:
        raise UnsafeName(
            f"object key {_shorten(key)!r} is too long to publish: its temp name would "
            f"exceed {MAX_KEY_CHARS} characters; use a key of at most "
            f"{MAX_KEY_CHARS - (len(candidate) - len(key))} characters"
        )
    return candidate


def is_temp_key(key: str) -> bool:
    """True if ``key`` (valid or not) names a temp object made by :func:`temp_key`."""
    return temp_key_writer(key) is not None


def temp_key_writer(key: str) -> tuple[int, str | None] | None:
    """(pid, start time or None) of the process that made temp key ``key``, or None
    if it is no temp key.

    A checker uses it (:func:`sparkcache.holders.process_alive`) to tell an
    abandoned temp file (its writer is dead, or its pid now names another
    process) from one still being written.
    """
    if not isinstance(key, str):
        return None
    match = _TEMP_RE.fullmatch(key.rsplit("/", 1)[-1])
    return (int(match.group("pid")), match.group("start")) if match else None


def _shorten(text: str, limit: int = 80) -> str:
    """Clip ``text`` for error messages (a 10,000-character key is not worth echoing)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
