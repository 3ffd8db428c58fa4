"""Name and device scopes: nesting, reset, thread-locality, restoration after exceptions."""

from __future__ import annotations

import threading

import pytest

from graphpar.core import (
    CPU,
    CUDA,
    BlobReference,
    CurrentDeviceScope,
    CurrentNameScope,
    DeviceOption,
    DeviceScope,
    NameScope,
    ScopedBlobReference,
    ScopedName,
)


def test_name_scope_nesting_appends_and_restores() -> None:
    assert CurrentNameScope() == ""
    with NameScope("gpu_0"):
        assert CurrentNameScope() == "gpu_0/"
        with NameScope("block/"):  # a trailing slash is not doubled
            assert CurrentNameScope() == "gpu_0/block/"
            assert ScopedName("w") == "gpu_0/block/w"
        assert CurrentNameScope() == "gpu_0/"
    assert CurrentNameScope() == ""


def test_name_scope_reset_replaces_and_empty_prefix_adds_nothing() -> None:
    with NameScope("a"):
        with NameScope("b", reset=True):
            assert CurrentNameScope() == "b/"
        with NameScope(""), NameScope(None):
            assert CurrentNameScope() == "a/"
        with NameScope(None, reset=True):
            assert CurrentNameScope() == ""
        assert CurrentNameScope() == "a/"


def test_scopes_restore_after_exceptions() -> None:
    option = DeviceOption(CUDA, 1)
    with pytest.raises(RuntimeError, match="boom"):
        with NameScope("outer"), DeviceScope(option):
            with NameScope("inner"), DeviceScope(DeviceOption(CPU)):
                raise RuntimeError("boom")
    assert CurrentNameScope() == ""
    assert CurrentDeviceScope() is None


def test_device_scope_nesting_and_clearing() -> None:
    gpu1, gpu2 = DeviceOption(CUDA, 1), DeviceOption(CUDA, 2)
    assert CurrentDeviceScope() is None
    with DeviceScope(gpu1):
        assert CurrentDeviceScope() == gpu1
        with DeviceScope(gpu2):
            assert CurrentDeviceScope() == gpu2
            with DeviceScope(None):
                assert CurrentDeviceScope() is None
            assert CurrentDeviceScope() == gpu2
        assert CurrentDeviceScope() == gpu1
    assert CurrentDeviceScope() is None


def test_scope_arguments_are_type_checked() -> None:
    with pytest.raises(TypeError, match="DeviceOption"):
        with DeviceScope(1):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="str"):
        with NameScope(3):  # type: ignore[arg-type]
            pass
    assert CurrentNameScope() == "" and CurrentDeviceScope() is None


def test_scopes_are_thread_local() -> None:
    seen: dict[str, object] = {}
    entered, release = threading.Event(), threading.Event()

    def worker() -> None:
        seen["name_before"], seen["device_before"] = CurrentNameScope(), CurrentDeviceScope()
        with NameScope("worker"), DeviceScope(DeviceOption(CUDA, 3)):
            entered.set()
            release.wait(5)
            seen["name_inside"] = CurrentNameScope()

    with NameScope("main"), DeviceScope(DeviceOption(CUDA, 0)):
        thread = threading.Thread(target=worker)
        thread.start()
        entered.wait(5)
        assert CurrentNameScope() == "main/"  # the worker's scopes do not leak here
        assert CurrentDeviceScope() == DeviceOption(CUDA, 0)
        release.set()
        thread.join(5)
    assert seen == {"name_before": "", "device_before": None, "name_inside": "worker/"}


def test_scoped_blob_reference() -> None:
    with NameScope("gpu_2"):
        ref = ScopedBlobReference("fc_w")
        plain = BlobReference("fc_w")  # the plain constructor does not scope
    assert isinstance(ref, BlobReference)
    assert ref == "gpu_2/fc_w" and plain == "fc_w"
    assert ref.GetNameScope() == "gpu_2/" and ref.GetUnscopedName() == "fc_w"
