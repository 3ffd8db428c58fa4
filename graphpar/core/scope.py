"""Thread-local name and device scopes; nesting restores the previous value on exit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from graphpar.core.ir import BlobReference, DeviceOption, as_device_option

_state = threading.local()


def CurrentNameScope() -> str:  # noqa: N802 - Caffe2 name
    """The current name scope, '' or ending in '/'."""
    return getattr(_state, "name_scope", "")


def CurrentDeviceScope() -> DeviceOption | None:  # noqa: N802
    """The device option new ops get, or None outside any DeviceScope."""
    return getattr(_state, "device_option", None)


@contextmanager
def NameScope(prefix: str | None, reset: bool = False) -> Iterator[None]:  # noqa: N802
    """Append `prefix/` to the name scope (replace it with `reset=True`); '' or None adds nothing.

    A trailing '/' in `prefix` is not doubled (Caffe2 would write 'a//'). The previous scope comes
    back on exit, also when the block raises. Raises TypeError if `prefix` is not a str or None.
    """
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"NameScope prefix must be a str, got {type(prefix).__name__}")
    old = CurrentNameScope()
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    _state.name_scope = prefix if reset else old + prefix
    try:
        yield
    finally:
        _state.name_scope = old


@contextmanager
def DeviceScope(device_option: DeviceOption | None, node_name: str | None = None) -> Iterator[None]:  # noqa: N802
    """Ops created inside (and blobs fed inside) get `device_option`; None clears the device scope.
    With `node_name` (Caffe2's), the scope is `device_option` (CPU when it is None or 0) on that node.

    The previous device scope comes back on exit, also when the block raises. Raises TypeError if
    `device_option` is not a DeviceOption or None.
    """
    if node_name is not None:
        base = as_device_option(device_option) if device_option else DeviceOption()
        if not isinstance(base, DeviceOption) or not isinstance(node_name, str):
            raise TypeError(f"DeviceScope needs a DeviceOption and a str node_name, got {device_option!r}, "
                            f"{node_name!r}")
        device_option = replace(base, node_name=node_name)
    device_option = as_device_option(device_option)
    if device_option is not None and not isinstance(device_option, DeviceOption):
        raise TypeError(f"DeviceScope needs a DeviceOption, got {type(device_option).__name__}")
    old = CurrentDeviceScope()
    _state.device_option = device_option
    try:
        yield
    finally:
        _state.device_option = old


def ScopedName(name: str) -> str:  # noqa: N802
    """`name` prefixed with the current name scope."""
    return CurrentNameScope() + name


def ScopedBlobReference(name: str, net: object = None) -> BlobReference:  # noqa: N802
    """A BlobReference to `name` inside the current name scope."""
    return BlobReference(ScopedName(name), net)
