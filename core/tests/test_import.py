"""``import spore`` stays cheap: no plugin, no torch._dynamo / torch._inductor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
import spore
spore.hookimpl
mods = sorted(sys.modules)
print(json.dumps({
    "torch": "torch" in sys.modules,
    "heavy": [m for m in mods if m.startswith(("torch._dynamo", "torch._inductor"))],
    "plugins": [m for m in mods if m.startswith("spore_fixture_")],
}))
"""


def test_import_spore_imports_no_plugin_and_no_torch(fixtures_dir) -> None:
    env = dict(os.environ, PYTHONPATH=str(fixtures_dir / "healthy"))
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"torch": False, "heavy": [], "plugins": []}


def test_mindspore_frontend_says_what_is_missing() -> None:
    import importlib.util

    import pytest

    if importlib.util.find_spec("mindspore") is not None:
        import spore.frontends.mindspore as frontend

        assert hasattr(frontend, "DispatchMode")
        return
    with pytest.raises(ImportError, match="needs MindSpore: pip install mindspore"):
        import spore.frontends.mindspore  # noqa: F401


def test_spore_testing_without_pytest_says_what_to_install() -> None:
    probe = "import sys; sys.modules['pytest'] = None; import spore.testing"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: spore.testing is a pytest plugin and needs pytest: "
        "pip install 'spore-core[test]' (or pip install pytest)"
    ), out.stderr
