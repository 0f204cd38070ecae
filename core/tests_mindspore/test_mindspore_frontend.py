"""Run by `nox -s mindspore` only (MindSpore is ~3 GB installed)."""

from __future__ import annotations

import mindspore
import numpy as np
import pytest
from mindspore import Tensor, ops

from spore.frontends import mindspore as frontend


def test_dispatch_mode_counts_and_nests() -> None:
    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    with frontend.OpCounter() as outer:
        _ = x * 2
        with frontend.OpCounter() as inner:
            y = x + x
        _ = x - x
    assert y.asnumpy().tolist() == [2.0, 4.0, 6.0]
    assert sum(inner.counts.values()) == 1
    assert sum(outer.counts.values()) >= 2


def test_saved_tensor_hooks_compose_and_keep_gradients() -> None:
    events = []

    def fn(x):
        outer = frontend.saved_tensors_hooks(lambda t: ("outer", t), lambda p: p[1])
        inner = frontend.saved_tensors_hooks(lambda p: events.append(p[0]) or p, lambda p: p)
        with outer, inner:
            return (ops.sin(x) * x).sum()

    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    hooked = mindspore.grad(fn)(x).asnumpy()
    plain = mindspore.grad(lambda v: (ops.sin(v) * v).sum())(x).asnumpy()
    assert events
    assert set(events) == {"outer"}
    np.testing.assert_array_equal(hooked, plain)


def test_one_hooks_object_is_entered_again_and_decorates_a_function() -> None:
    """As ``spore.saved_tensors_hooks``: a generator context manager raised
    ``AttributeError: '_GeneratorContextManager' object has no attribute 'args'`` when entered
    a second time."""
    packed: list[str] = []
    outer = frontend.saved_tensors_hooks(lambda t: packed.append("outer") or t, lambda t: t)
    inner = frontend.saved_tensors_hooks(lambda t: packed.append("inner") or t, lambda t: t)

    def step(v):
        with outer:
            return ops.sin(v).sum()

    def nested(v):
        with outer, inner, inner:  # the second inside its own block: composed once more
            return ops.sin(v).sum()

    @inner
    def decorated(v):
        return ops.sin(v).sum()

    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    mindspore.grad(step)(x)
    saved = len(packed)  # tensors one step saves
    assert saved > 0
    mindspore.grad(step)(x)  # one object per training loop, entered each step
    assert packed == ["outer"] * 2 * saved
    packed.clear()
    mindspore.grad(nested)(x)
    assert packed == ["outer", "inner", "inner"] * saved
    packed.clear()
    for _ in range(2):
        mindspore.grad(decorated)(x)
    assert packed == ["inner"] * 2 * saved


def test_plugin_forwarding_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        frontend.register_custom_pass("p", str(tmp_path / "missing.so"))
    with pytest.raises(ValueError, match="device must be"):
        frontend.register_custom_pass("p", str(tmp_path / "missing.so"), device="tpu")
    not_a_library = tmp_path / "empty.so"
    not_a_library.write_bytes(b"")
    with pytest.raises(RuntimeError, match="MindSpore refused pass 'p'"):
        frontend.register_custom_pass("p", str(not_a_library))
    with pytest.raises(RuntimeError, match="MindSpore refused backend 'b'"):
        frontend.register_custom_backend("b", str(not_a_library))


def test_the_documented_example_runs(tmp_path) -> None:
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "core" / "mindspore.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text(block)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
