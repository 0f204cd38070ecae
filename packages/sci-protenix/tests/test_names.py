"""The package's lazy names: each is the object its module defines, on every access."""

from __future__ import annotations

import importlib

import pytest

import sci_protenix


@pytest.mark.parametrize("name", sorted(sci_protenix._LAZY))
def test_a_lazy_name_stays_its_object_after_its_module_is_imported(name: str) -> None:
    module = importlib.import_module(sci_protenix._LAZY[name])
    first = getattr(sci_protenix, name)
    assert first is getattr(module, name)
    assert getattr(sci_protenix, name) is first  # a submodule of that name would shadow it


def test_boost_is_callable_however_it_was_reached() -> None:
    from sci_protenix import boost

    assert callable(boost)
    assert callable(sci_protenix.boost)
    assert sci_protenix.boost is boost


def test_the_modules_apply_plan_names_are_the_packages() -> None:
    from sci_protenix.chunking import PLANNED

    assert all(isinstance(getattr(sci_protenix, name), type) for name in PLANNED)
