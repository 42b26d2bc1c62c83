"""sparkcache.buffers: the one byte view every layer uses for pages, destinations and chunks,
and the aligned scratch buffers positional reads land in."""

from __future__ import annotations

import numpy as np
import pytest

from sparkcache.buffers import PAGE_ALIGN, aligned_empty, as_byte_view
from sparkcache.errors import InvalidArgument, NotABuffer


@pytest.mark.parametrize("buf", [
    np.arange(12, dtype=np.float16).reshape(3, 4),
    np.zeros((2, 3), ">f4"),  # a non-native byte order is viewed as it lies
    bytearray(b"abcdef"),
    memoryview(b"xyz"),
    b"",
])
def test_views_any_contiguous_buffer_without_copying(buf: object) -> None:
    view = as_byte_view(buf)
    assert view.dtype == np.uint8 and view.ndim == 1
    assert view.tobytes() == bytes(memoryview(buf))  # type: ignore[arg-type]


def test_a_view_writes_through_to_the_buffer() -> None:
    arr = np.zeros((2, 4), np.float32)
    view = as_byte_view(arr, writable=True)
    view[:4] = np.frombuffer(np.float32(1.5).tobytes(), np.uint8)
    assert arr[0, 0] == 1.5


def test_read_only_and_strided_buffers() -> None:
    with pytest.raises(InvalidArgument, match="writable"):
        as_byte_view(b"abc", writable=True)
    strided = np.arange(10, dtype=np.int32)[::2]
    with pytest.raises(InvalidArgument, match="contiguous"):
        as_byte_view(strided)
    assert as_byte_view(strided, copy=True).tobytes() == strided.tobytes()  # one copy
    with pytest.raises(InvalidArgument, match="contiguous"):
        as_byte_view(strided, writable=True, copy=True)  # a copy cannot be a destination


def test_a_non_buffer_is_invalid_and_a_type_error() -> None:
    with pytest.raises(NotABuffer) as info:
        as_byte_view("text")
    assert isinstance(info.value, TypeError) and isinstance(info.value, InvalidArgument)
    assert "str" in str(info.value)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 1 << 20])
@pytest.mark.parametrize("align", [64, PAGE_ALIGN])
def test_aligned_buffers_start_at_a_multiple(nbytes: int, align: int) -> None:
    """Each of several buffers starts at a multiple of ``align`` (numpy's own
    start 16 bytes into a page), holds ``nbytes`` and is writable."""
    for _ in range(4):
        buf = aligned_empty(nbytes, align)
        assert buf.dtype == np.uint8 and buf.shape == (nbytes,) and buf.flags.writeable
        assert buf.ctypes.data % align == 0 or nbytes == 0  # (no memory to place)
        buf[:] = 7


def test_an_alignment_that_is_not_a_power_of_two_is_refused() -> None:
    for align in (0, -64, 48):
        with pytest.raises(InvalidArgument, match="power of two"):
            aligned_empty(16, align)
