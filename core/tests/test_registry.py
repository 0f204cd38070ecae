from __future__ import annotations

from dataclasses import dataclass

import pytest

from spore.registry import USER, DuplicateRegistrationError, Registry, make_registries


@dataclass
class Thing:
    name: str


def test_add_get_and_owner() -> None:
    reg: Registry[Thing] = Registry("thing")
    with reg.owned_by("alpha"):
        reg.add(Thing("a"))
    reg.add(Thing("b"))
    assert reg.get("a") == Thing("a")
    assert reg.entry("a").owner == "alpha"
    assert reg.entry("b").owner == USER
    assert list(reg) == ["a", "b"]
    assert reg.names(owner="alpha") == ["a"]
    assert "a" in reg
    assert len(reg) == 2


def test_duplicate_names_both_owners_and_override() -> None:
    reg: Registry[Thing] = Registry("thing")
    with reg.owned_by("alpha"):
        reg.add(Thing("x"))
    with reg.owned_by("beta"), pytest.raises(DuplicateRegistrationError) as info:
        reg.add(Thing("x"))
    assert "'alpha'" in str(info.value)
    assert "'beta'" in str(info.value)
    assert "override=True" in str(info.value)
    with reg.owned_by("beta"):
        reg.add(Thing("y"))
    with reg.owned_by("beta"), pytest.raises(DuplicateRegistrationError) as again:
        reg.add(Thing("y"))
    assert str(again.value) == (  # it said "registered by both 'beta' and 'beta'"
        "thing 'y' is already registered by 'beta'; use another name, or pass override=True "
        "to replace it"
    )
    replacement = Thing("x")
    with reg.owned_by("beta"):
        reg.add(replacement, override=True)
    assert reg.get("x") is replacement
    assert reg.entry("x").owner == "beta"


def test_remove_owner() -> None:
    reg: Registry[object] = Registry("op")
    with reg.owned_by("alpha"):
        reg.add(object(), name="one")
        reg.add(object(), name="two")
    reg.add(object(), name="three")
    reg.remove_owner("alpha")
    assert list(reg) == ["three"]


def test_removing_an_owner_brings_back_what_it_replaced() -> None:
    """A failing plugin that had replaced another's entry (override=True) took that name
    away with it; the replaced entry now comes back, whatever order owners leave in."""
    reg: Registry[Thing] = Registry("thing")
    first, second, third = Thing("x"), Thing("x"), Thing("x")
    for owner, thing in (("alpha", first), ("beta", second), ("gamma", third)):
        with reg.owned_by(owner):
            reg.add(thing, override=True)
    with reg.owned_by("beta"):
        reg.add(Thing("x"), override=True)  # an owner replacing its own entry shadows nothing
    assert reg.remove_owner("gamma") == []  # beta's entry was on top
    assert reg.entry("x").owner == "beta"
    assert [e.value for e in reg.remove_owner("beta")] == [first]
    assert reg.get("x") is first
    assert reg.remove_owner("alpha") == []
    assert "x" not in reg


def test_a_failed_plugin_hands_a_backend_and_a_pass_back(spore_manager) -> None:
    import torch

    from spore.backends import Backend
    from spore.registry import BackendRegistry, PassRegistry

    name = f"spore_test_restored_{id(object())}"
    calls = []
    backends = BackendRegistry("backend")
    passes = PassRegistry("pass")
    with backends.owned_by("alpha"), passes.owned_by("alpha"):
        backends.add(Backend(name, lambda gm, ex: calls.append("alpha") or gm.forward))
        passes.add(lambda gm: 0, name="tidy")
    with backends.owned_by("beta"), passes.owned_by("beta"):
        backends.add(Backend(name, lambda gm, ex: gm.forward), override=True)
        passes.add(lambda gm: 1, name="tidy", override=True)
    backends.remove_owner("beta")
    passes.remove_owner("beta")
    assert passes.entry("tidy").owner == "alpha"
    torch._dynamo.reset()
    torch.compile(lambda x: x.sin() + 1, backend=name)(torch.ones(2))
    assert calls == ["alpha"]
    backends.remove_owner("alpha")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="withdrawn"):
        torch.compile(lambda x: x.cos() + 1, backend=name)(torch.ones(2))


def test_bad_names_are_clear_errors() -> None:
    reg: Registry[object] = Registry("op")
    with pytest.raises(TypeError, match="no 'name' attribute; pass name="):
        reg.add(object())
    with pytest.raises(ValueError, match="non-empty"):
        reg.add(object(), name="")
    for bad in (5, b"x"):  # sorted with str names, they broke names(), get() and listings
        with pytest.raises(TypeError, match=f"a op name must be a str, got {type(bad).__name__}"):
            reg.add(object(), name=bad)  # type: ignore[arg-type]
    assert list(reg) == []
    with pytest.raises(KeyError, match=r"no op named 'missing' \(registered: none\)"):
        reg.get("missing")


def test_the_owner_version_is_recorded_with_the_owner() -> None:
    reg: Registry[Thing] = Registry("thing")
    with reg.owned_by("alpha", "1.2.3"):
        reg.add(Thing("a"))
    reg.add(Thing("b"))
    assert (reg.entry("a").owner, reg.entry("a").owner_version) == ("alpha", "1.2.3")
    assert (reg.entry("b").owner, reg.entry("b").owner_version) == (USER, "")


def test_every_kind_has_its_registry_class_from_one_module() -> None:
    registries = make_registries()
    assert {kind: type(r).__name__ for kind, r in registries.items()} == {
        "ops": "OpRegistry",
        "passes": "PassRegistry",
        "backends": "BackendRegistry",
        "benchmarks": "BenchmarkRegistry",
    }
    assert {type(r).__module__ for r in registries.values()} == {"spore.registry"}
    assert make_registries()["ops"] is not registries["ops"]
