"""Exceptions shared by the registries and the mechanisms they feed (dispatch, backends)."""

from __future__ import annotations


class DuplicateRegistrationError(ValueError):
    """A name was registered twice without ``override=True``."""


__all__ = ["DuplicateRegistrationError"]
