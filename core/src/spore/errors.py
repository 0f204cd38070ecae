"""Exceptions and argument checks shared by the registries and the mechanisms they feed
(dispatch, backends, graph passes), and the plugin manager's error (raised by
:mod:`spore.plugins`, reported by :mod:`spore.doctor`)."""

from __future__ import annotations


class DuplicateRegistrationError(ValueError):
    """A name was registered twice without ``override=True``."""


class PluginError(RuntimeError):
    """A plugin failed in strict mode, or a plugin asked for by name is not active."""


def check_device_type(device: object, what: str) -> None:
    """Refuse anything but a lower-case device type (``cpu``, ``cuda``, ``npu``) for ``what``."""
    if not isinstance(device, str) or not device.isidentifier() or device != device.lower():
        raise ValueError(
            f"{what} must be a lower-case device type like 'cpu' or 'cuda' (not a device such "
            f"as 'cuda:0'), got {device!r}"
        )


def check_sub_provider(provider: object, owner: str, who: str) -> None:
    """Refuse a kernel provider other than ``owner`` itself or ``"<owner>:<name>"`` from
    ``who`` (e.g. ``plugin 'acme'``): ``TypeError`` for a non-str, ``ValueError`` for another
    str."""
    form = f"{who} registers kernels as {owner!r} or {owner!r}:<name>"
    if not isinstance(provider, str):
        raise TypeError(
            f"{form}; a provider must be a str, got {type(provider).__name__} {provider!r}"
        )
    if provider != owner and (not provider.startswith(f"{owner}:") or provider == f"{owner}:"):
        raise ValueError(f"{form}, not {provider!r}")


__all__ = [
    "DuplicateRegistrationError",
    "PluginError",
    "check_device_type",
    "check_sub_provider",
]
