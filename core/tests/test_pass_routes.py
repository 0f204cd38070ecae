"""A pip-installed plugin's pass runs through each route, in a fresh process, and only there.

The plugin is a real distribution (a dist-info with a ``spore.plugins`` entry point) written to
a temporary folder on the child's ``PYTHONPATH``. Each child has its own Inductor cache folder
(``TORCHINDUCTOR_CACHE_DIR``) unless it is meant to share one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PLUGIN = "spore_fixture_passes"

PLUGIN_SOURCE = textwrap.dedent(
    """
    import spore

    FIRED = []


    class CountCalls(spore.GraphPass):
        name = "fixture-count-calls"

        def __call__(self, gm):
            FIRED.append(sum(n.op == "call_function" for n in gm.graph.nodes))
            return 0


    @spore.hookimpl
    def spore_register_passes(registry):
        registry.add(CountCalls(), stage="post_grad")
    """
)

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch._dynamo.utils import counters

    route = sys.argv[1]
    result = {}

    def f(x):
        return (x * 2 + 1).sin()

    def g(x):
        return (x - 1).cos()

    def compile_and_run(fn, backend="inductor"):
        torch._dynamo.reset()
        x = torch.randn(8)
        torch.testing.assert_close(torch.compile(fn, backend=backend)(x), fn(x))

    def fired():
        plugin = sys.modules.get("PLUGIN")
        return None if plugin is None else list(plugin.FIRED)

    def cache():
        return [counters["inductor"]["fxgraph_cache_hit"],
                counters["inductor"]["fxgraph_cache_miss"]]

    if route == "neither":
        compile_and_run(f)
        result["plain"] = fired()  # None: the plugin was not even imported
        import spore
        spore.get_registry("passes")  # loaded, registered, but not turned on
        compile_and_run(g)
        result["loaded"] = fired()
    elif route == "enable":
        import spore.passes
        spore.passes.enable()
        spore.passes.enable()
        compile_and_run(f)
        result["first"], result["first_cache"] = fired(), cache()
        compile_and_run(f)
        result["again"], result["again_cache"] = fired(), cache()
    else:  # "spore", and "spore-only" without the later plain compile
        compile_and_run(f, backend="spore")
        result["spore"], result["cache"] = fired(), cache()
        if route == "spore":
            from torch._inductor import config
            result["slot_after"] = repr(config.post_grad_custom_post_pass)
            compile_and_run(g)
            result["plain_after"] = fired()
    print(json.dumps(result))
    """
).replace("PLUGIN", PLUGIN)


def _write_plugin(root: Path, version: str) -> Path:
    """A ``spore-fixture-passes`` distribution at ``version`` in ``root``; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    info = root / f"{PLUGIN}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: spore-fixture-passes\nVersion: {version}\n"
        "Requires-Dist: spore-core>=0.1,<0.2\n"
    )
    (info / "entry_points.txt").write_text(f"[spore.plugins]\npasses = {PLUGIN}\n")
    return root


def _start(route: str, plugin: Path, cache: Path, cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPORE_", "TORCHINDUCTOR_"))}
    env.update(
        PYTHONPATH=str(plugin),
        SPORE_PLUGINS="passes",  # only the fixture: the other installed plugins stay out
        TORCHINDUCTOR_CACHE_DIR=str(cache),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
    )
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, route],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )


def _result(child: subprocess.Popen[str]) -> dict:
    try:
        out, err = child.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise AssertionError(f"child {child.args[-1]} timed out:\n{err[-3000:]}") from None
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.splitlines()[-1])


def test_the_pass_fires_through_each_route_and_not_without_one(tmp_path: Path) -> None:
    plugin = _write_plugin(tmp_path / "site-1.0.0", "1.0.0")
    shared = tmp_path / "cache-shared"
    first_wave = {
        "neither": _start("neither", plugin, tmp_path / "cache-neither", tmp_path),
        "enable": _start("enable", plugin, tmp_path / "cache-enable", tmp_path),
        "spore": _start("spore", plugin, shared, tmp_path),
    }
    results = {route: _result(child) for route, child in first_wave.items()}

    assert results["neither"] == {"plain": None, "loaded": []}, "no route: no pass may run"

    enable = results["enable"]
    assert enable["first"] == [3], "spore.passes.enable() + default inductor runs the pass"
    assert enable["first_cache"] == [0, 1]
    assert enable["again"] == [3], "an unchanged setup hits the FX graph cache: no pass runs"
    assert enable["again_cache"] == [1, 1]

    spore = results["spore"]
    assert spore["spore"] == [3], "backend='spore' runs the pass"
    assert spore["cache"] == [0, 1]
    assert spore["slot_after"] == "None", "backend='spore' leaves Inductor's config as it was"
    assert spore["plain_after"] == [3], "a later plain compile must not run the pass"

    # the same installation in new processes hits the cache; a new plugin version misses it
    bumped = _write_plugin(tmp_path / "site-1.0.1", "1.0.1")
    second_wave = {
        "same": _start("spore-only", plugin, shared, tmp_path),
        "bumped": _start("spore-only", bumped, shared, tmp_path),
    }
    same, bumped_result = (_result(child) for child in second_wave.values())
    assert (same["spore"], same["cache"]) == ([], [1, 0]), "unchanged: a cache hit, no pass"
    assert (bumped_result["spore"], bumped_result["cache"]) == ([3], [0, 1]), (
        "a new plugin version changes the cache key: a miss, and the pass runs"
    )
