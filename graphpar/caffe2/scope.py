"""Caffe2's `scope` module: name and device scopes (they live in `graphpar.core.scope`)."""

from __future__ import annotations

from graphpar.core.scope import (
    CurrentDeviceScope,
    CurrentNameScope,
    DeviceScope,
    NameScope,
)

_NAMESCOPE_SEPARATOR = "/"  # Caffe2's constant, read by scripts that build scoped names by hand

__all__ = ["CurrentDeviceScope", "CurrentNameScope", "DeviceScope", "NameScope"]
