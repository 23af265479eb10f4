"""Process set-up before compiling: the host allocator's settings."""

import pytest


def test_cpu_host_allocator_keeps_freed_memory(monkeypatch):
    import platform

    from scalestudy.train.runtime.host_setup import tune_host_allocator

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert tune_host_allocator() == {
        "MALLOC_TRIM_THRESHOLD_": 1 << 30,
        "MALLOC_TOP_PAD_": 1 << 28,
        "MALLOC_MMAP_THRESHOLD_": 1 << 25,
    }
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")  # a user's own setting wins
    assert "MALLOC_TOP_PAD_" not in tune_host_allocator()
