from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import spore
from spore.backends import Backend, active
from spore.registry import DuplicateRegistrationError

_names = itertools.count()


def _name() -> str:
    return f"spore_test_backend_{next(_names)}"


def _fn(x):
    return torch.sin(x) * 2


def test_register_and_compile(spore_manager) -> None:
    spore_manager()
    seen = []

    def compiler(gm, example_inputs):
        seen.append([n.op for n in gm.graph.nodes])
        return gm.forward

    name = _name()
    spore.register_custom_backend(name, compiler)
    x = torch.randn(5)
    torch.testing.assert_close(torch.compile(_fn, backend=name)(x), _fn(x))
    assert seen
    assert "call_function" in seen[0]
    assert name in torch._dynamo.list_backends(exclude_tags=())
    assert spore.get_registry("backends").entry(name).owner == "user"


def test_failing_backend_raises_with_cause_unless_fallback(spore_manager) -> None:
    spore_manager()

    def broken(gm, example_inputs):
        raise RuntimeError("no code generator today")

    strict = _name()
    spore.register_custom_backend(strict, broken)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no code generator today") as info:
        torch.compile(_fn, backend=strict)(torch.randn(3))
    assert "BackendCompilerFailed" in type(info.value).__name__
    # raised from None (as the docs say): the error is on .inner_exception, not the cause
    assert info.value.__cause__ is None
    assert isinstance(info.value.inner_exception, RuntimeError)

    lenient = _name()
    spore.register_custom_backend(lenient, broken, fallback=True)
    torch._dynamo.reset()
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(_fn, backend=lenient)(x)
    torch.testing.assert_close(out, _fn(x))
    assert any("runs eagerly" in str(w.message) for w in caught)


def test_duplicates_override_and_reload(spore_manager) -> None:
    spore_manager()
    name = _name()
    first = spore.register_custom_backend(name, lambda gm, ex: gm.forward)
    with pytest.raises(DuplicateRegistrationError, match="is already registered by 'user'"):
        spore.register_custom_backend(name, lambda gm, ex: gm.forward)
    replacement = spore.register_custom_backend(name, lambda gm, ex: gm.forward, override=True)
    assert active()[name] is replacement is not first
    spore_manager()  # a second manager re-registers the same backend: harmless
    spore.get_registry("backends").add(replacement)
    with pytest.raises(DuplicateRegistrationError, match="is already registered by 'user'"):
        spore.get_registry("backends").add(replacement)  # the same object, the same registry
    for _ in range(2):  # refused by dynamo, the name is not left behind in Spore's registry
        with pytest.raises(DuplicateRegistrationError, match=r"torch\._dynamo already has"):
            spore.register_custom_backend("inductor", lambda gm, ex: gm.forward)
    assert "inductor" not in spore.get_registry("backends")
    with pytest.raises(ValueError, match="Python identifier"):
        Backend("not a name", lambda gm, ex: gm.forward)
    with pytest.raises(TypeError, match="backend name must be a str, got int"):  # AttributeError
        spore.register_custom_backend(5, lambda gm, ex: gm.forward)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"register a spore\.backends\.Backend"):
        spore.get_registry("backends").add(object())


def test_plugin_backend_and_withdrawal(fixture_plugins, spore_manager) -> None:
    fixture_plugins("dynamo")
    manager = spore_manager()
    registry = manager.registry("backends")
    assert registry.entry("spore_fixture_counting").owner == "dynamo"
    torch._dynamo.reset()
    x = torch.randn(4)
    torch.compile(_fn, backend="spore_fixture_counting")(x)
    assert sys.modules["spore_fixture_dynamo"].COMPILED
    registry.remove_owner("dynamo")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="was withdrawn"):
        torch.compile(_fn, backend="spore_fixture_counting")(x)


def test_a_withdrawn_backends_name_can_be_registered_again(fixture_plugins, spore_manager) -> None:
    fixture_plugins("hookexit")  # registers spore_fixture_quitter, then fails: it is withdrawn
    spore_manager()
    seen = []

    def compiler(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    spore.register_custom_backend("spore_fixture_quitter", compiler)
    torch._dynamo.reset()
    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(_fn, backend="spore_fixture_quitter")(x), _fn(x))
    assert seen
    assert spore.get_registry("backends").entry("spore_fixture_quitter").owner == "user"


def test_dynamo_entry_point_found_by_torch_compile_alone(fixtures_dir) -> None:
    """User code imports only torch; dynamo finds the backend through the entry point."""
    code = (
        "import torch; "
        "f = torch.compile(lambda x: x + 1, backend='spore_fixture_ep'); "
        "print(f(torch.ones(2)).tolist())"
    )

    env = dict(os.environ, PYTHONPATH=str(fixtures_dir / "dynamo"))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "compiled by the torch_dynamo_backends entry point" in out.stdout
    assert "[2.0, 2.0]" in out.stdout


@pytest.mark.core_alone
def test_spore_backends_cli(run_spore) -> None:
    out = run_spore("backends", "--json", plugins=("dynamo",))
    assert json.loads(out.stdout) == [
        {
            "name": "spore",
            "registered_by": "core",
            "fallback": False,
            "description": "Inductor with the graph passes registered through Spore (spore passes)",
        },
        {
            "name": "spore_fixture_counting",
            "registered_by": "dynamo",
            "fallback": False,
            "description": "counts graphs",
        },
    ]
    alone = json.loads(run_spore("backends", "--json").stdout)
    assert [r["name"] for r in alone] == ["spore"]  # the core's own, dynamo's entry point
