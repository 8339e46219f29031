"""The fused copy + CRC-64 (C extension and its awscrt + numpy fallback) against awscrt.

Every implementation level the CPU has is exercised with random lengths, source and
destination offsets (so the alignment heads and the 16/64/256-byte tails all occur) and
running CRC values; awscrt's CRC-64/NVME is the reference throughout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.transport import copying
from topkv.wire.checksum import crc64

try:
    from topkv import _copycrc  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the install having a C compiler
    _copycrc = None

needs_native = pytest.mark.skipif(
    _copycrc is None, reason=f"C extension not built: {copying.NATIVE_STATUS}"
)
LEVELS = list(range(_copycrc.LEVEL + 1)) if _copycrc is not None else []


def native() -> ModuleType:
    assert _copycrc is not None
    return _copycrc


def test_the_extension_is_built_where_ci_requires_it() -> None:
    """``.ci/run`` sets TOPKV_REQUIRE_NATIVE=1: there, a missing build is a failure."""
    if os.environ.get("TOPKV_REQUIRE_NATIVE") != "1":
        pytest.skip("TOPKV_REQUIRE_NATIVE is not set")
    assert copying.NATIVE, copying.NATIVE_STATUS


@needs_native
def test_check_value_at_every_level() -> None:
    for level in LEVELS:
        assert native().crc64(b"123456789", 0, level) == 0xAE8B14860A799888


@needs_native
@given(
    data=st.binary(max_size=5000),
    src_offset=st.integers(0, 63),
    dst_offset=st.integers(0, 63),
    prev=st.integers(0, 2**64 - 1),
)
def test_copy_crc64_equals_awscrt_at_every_level(
    data: bytes, src_offset: int, dst_offset: int, prev: int
) -> None:
    src = memoryview(bytes(src_offset) + data)[src_offset:]
    want = crc64(data, prev)
    for level in LEVELS:
        backing = bytearray(len(data) + dst_offset)
        dst = memoryview(backing)[dst_offset:]
        assert native().copy_crc64(dst, src, prev, level) == want, level
        assert bytes(dst) == data
        assert native().crc64(src, prev, level) == want, level
        plain = bytearray(len(data) + dst_offset)
        native().copy(memoryview(plain)[dst_offset:], src, level)
        assert bytes(plain[dst_offset:]) == data


@needs_native
@pytest.mark.parametrize("size", [(1 << 20) + 4093, 3 << 20])
def test_large_buffers_at_every_level(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    for level in LEVELS:
        dst = np.zeros_like(data)
        assert native().copy_crc64(dst, data, 0, level) == crc64(data)
        assert np.array_equal(dst, data)


@needs_native
def test_running_crc_over_pieces_equals_the_whole() -> None:
    data = os.urandom(100_000)
    crc = 0
    for start in range(0, len(data), 7777):
        crc = native().crc64(data[start : start + 7777], crc)
    assert crc == crc64(data)


@needs_native
def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="destination has 3 bytes, source 4"):
        native().copy_crc64(bytearray(3), b"abcd")
    with pytest.raises(TypeError):
        native().copy_crc64(b"read-only", b"read-only")
    with pytest.raises(ValueError, match="not available on this CPU"):
        native().crc64(b"x", 0, native().LEVEL + 1)


def _main_thread_ran_during(call: Callable[[], object]) -> bool:
    """Whether the main thread got to run while another thread was inside ``call()``.

    With a 10 s switch interval the GIL changes hands only when it is released, so the
    main thread's timestamp precedes the end of the call only if the call released it.
    """
    started = threading.Event()
    call_ended: list[int] = []

    def work() -> None:
        started.set()
        call()
        call_ended.append(time.perf_counter_ns())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        main_ran = time.perf_counter_ns()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    return main_ran < call_ended[0]


@needs_native
def test_large_copies_release_the_gil() -> None:
    data = np.random.default_rng(9).integers(0, 256, 128 << 20, dtype=np.uint8)
    dst = np.empty_like(data)
    assert not _main_thread_ran_during(lambda: bytes(data.data)), "control: bytes() holds it"
    assert _main_thread_ran_during(lambda: native().copy_crc64(dst, data))


@given(data=st.binary(max_size=3 * 4096), chunk=st.sampled_from([16, 1000, 4096]))
def test_fallback_equals_awscrt(data: bytes, chunk: int) -> None:
    dst = bytearray(len(data))
    saved = copying._native_copy_crc
    try:
        copying._native_copy_crc = None
        crc = copying.copy_with_crc(memoryview(dst), memoryview(data), chunk)
    finally:
        copying._native_copy_crc = saved
    assert crc == crc64(data)
    assert bytes(dst) == data


def test_copy_into_uses_whichever_path_is_loaded() -> None:
    data = os.urandom(300_001)
    dst = bytearray(len(data))
    copying.copy_into(memoryview(dst), memoryview(data))
    assert bytes(dst) == data
