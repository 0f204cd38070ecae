"""Exceptions and argument checks shared by the registries and the mechanisms they feed
(dispatch, backends, graph passes)."""

from __future__ import annotations


class DuplicateRegistrationError(ValueError):
    """A name was registered twice without ``override=True``."""


def check_device_type(device: object, what: str) -> None:
    """Refuse anything but a lower-case device type (``cpu``, ``cuda``, ``npu``) for ``what``."""
    if not isinstance(device, str) or not device.isidentifier() or device != device.lower():
        raise ValueError(
            f"{what} must be a lower-case device type like 'cpu' or 'cuda' (not a device such "
            f"as 'cuda:0'), got {device!r}"
        )


__all__ = ["DuplicateRegistrationError", "check_device_type"]
