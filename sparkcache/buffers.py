"""The byte-buffer helpers: any buffer as a flat uint8 array, without copying,
and page-aligned scratch buffers.

Pages handed to ``publish``, destinations handed to ``read_into`` and chunks
handed to a backend's ``put`` all come through :func:`as_byte_view`, so every
layer agrees on what a buffer is and says the same thing about a bad one.
Buffers that positional reads of segment files land in come from
:func:`aligned_empty`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from sparkcache.errors import InvalidArgument, NotABuffer

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["PAGE_ALIGN", "aligned_empty", "as_byte_view"]

#: The alignment of :func:`aligned_empty`'s buffers: a memory page (the
#: segment files' data starts at one too: ``segment.DATA_ALIGN``).
PAGE_ALIGN = 4096


def aligned_empty(nbytes: int, align: int = PAGE_ALIGN) -> np.ndarray:
    """An uninitialised flat uint8 array of ``nbytes`` whose first byte lies at a
    multiple of ``align`` (a power of two).  A positional read from a segment
    file lands at memory speed only where its destination and the file's data
    are aligned alike (the kernel copies from page-aligned page-cache pages;
    numpy's own buffers start 16 bytes into a page)."""
    if align <= 0 or align & (align - 1):
        raise InvalidArgument(f"align must be a power of two, got {align}")
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes]


def as_byte_view(buf: Any, *, writable: bool = False, copy: bool = False) -> np.ndarray:
    """A flat uint8 numpy view of ``buf`` (anything with the buffer protocol).

    C-contiguous buffers of any format (numpy arrays of any dtype, bytes,
    memoryviews, ...) are viewed in place.  A non-contiguous buffer (a strided
    numpy view) is copied once when ``copy`` is true and refused otherwise: a
    destination must be written in place, and a page buffer that is not
    contiguous is almost always a caller's mistake.  ``writable`` refuses
    read-only buffers.  Raises :class:`~sparkcache.errors.InvalidArgument`
    (:class:`~sparkcache.errors.NotABuffer`, also a TypeError, for an object
    without the buffer protocol).
    """
    try:
        mv = memoryview(cast("Buffer", buf))
    except TypeError as exc:
        raise NotABuffer(
            "expected a buffer (numpy array, bytes, bytearray or memoryview), got "
            f"{type(buf).__name__}"
        ) from exc
    if not mv.c_contiguous:
        if not copy or writable:
            raise InvalidArgument("buffers must be C-contiguous; pass a contiguous copy")
        return np.frombuffer(mv.tobytes(), dtype=np.uint8)
    if writable and mv.readonly:
        raise InvalidArgument("destination buffers must be writable")
    if not mv.nbytes:
        return np.zeros(0, np.uint8)
    # numpy reads any contiguous buffer's bytes as they are, whatever its format.
    return np.frombuffer(mv, dtype=np.uint8)
