"""``spore doctor``: environment checks from the core and from plugins."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from spore.errors import PluginError
from spore.runtime import runtime_environment, usable_cores

if TYPE_CHECKING:
    from spore.plugins import PluginInfo, PluginManager

STATUSES = ("ok", "info", "warn", "error")
AUTOLOAD_FIX = (
    "torch imports every installed device extension at start-up; set "
    "TORCH_DEVICE_BACKEND_AUTOLOAD=0 to skip them, or install the vendor runtime "
    "(for torch_npu: Ascend CANN, then `source set_env.sh`)"
)
WARMUP_CLONES = 8
"""How many 128 MiB clones the allocator check's warm-up measurement makes in a new process."""
WARMUP_FAULTS = 1000
"""A clone after the first with more page faults than this took new pages (a 128 MiB clone of
new pages takes 32768)."""
WARMUP_FIX = (
    "start CPU jobs with `spore run --allocator tuned -- CMD`, or add "
    "glibc.malloc.tcache_max=0 to GLIBC_TUNABLES (PyTorch's aligned allocations otherwise leave "
    "slivers in glibc's tcache that keep freed blocks from merging)"
)


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    source: str
    name: str
    status: str
    detail: str
    fix: str | None = None


class Report:
    """What ``spore_doctor`` hooks write to: ``report.add(name, status, detail, fix=...)``."""

    def __init__(self, *, quick: bool = False) -> None:
        self.checks: list[Check] = []
        self.quick = quick
        """When true, checks skip measurements that take seconds."""
        self._source = "user"

    def add(self, name: str, status: str, detail: str, *, fix: str | None = None) -> None:
        """Record a check; ``status`` is one of ``ok``, ``info``, ``warn``, ``error``."""
        if status not in STATUSES:
            raise ValueError(f"doctor status must be one of {STATUSES}, got {status!r}")
        self.checks.append(Check(self._source, name, status, detail, fix))

    @contextmanager
    def source(self, name: str) -> Iterator[None]:
        """Attribute checks added inside the block to plugin ``name``."""
        previous, self._source = self._source, name
        try:
            yield
        finally:
            self._source = previous

    @property
    def worst(self) -> str:
        """The most serious status reported (``ok`` when empty)."""
        return max((c.status for c in self.checks), key=STATUSES.index, default="ok")

    def to_dict(self) -> dict[str, Any]:
        return {"worst": self.worst, "checks": [asdict(c) for c in self.checks]}


def run(manager: PluginManager, *, quick: bool = False) -> Report:
    """Run every check: the core's, each plugin's ``spore_doctor``, then plugin health.

    A :class:`~spore.errors.PluginError` (strict mode, a plugin asked for by name) is an error
    check, not raised: one that stops the loading leaves the core's checks and the notes on
    the plugin selection alone; one from a plugin's ``spore_doctor`` leaves that plugin
    ``failed`` and the plugins after it unasked, which a warning says.
    """
    report = Report(quick=quick)
    try:
        manager.load()
    except PluginError as exc:
        with report.source("core"):
            core_checks(report)
            check_plugin_error(report, exc)
            check_selection(report, manager.notes)
        return report
    try:
        manager.run_doctor(report)
    except PluginError as exc:
        with report.source("core"):
            check_plugin_error(report, exc)
            report.add(
                "plugin checks",
                "warn",
                "the plugins after the failed one ran no checks: its error stopped them (strict "
                "mode, or a plugin asked for by name); fix it, or leave it out with "
                "SPORE_DISABLE_PLUGINS, to see theirs",
            )
    with report.source("core"):
        check_plugins(report, manager.plugins())
        check_selection(report, manager.notes)
    return report


def core_checks(report: Report) -> None:
    """The checks spore-core contributes itself."""
    check_python(report)
    torch = check_torch(report)
    if torch is not None:
        check_devices(report, torch)
    check_mindspore(report)
    check_compilers(report)
    check_threads(report, torch)
    if torch is not None and not report.quick:
        check_allocator(report)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_python(report: Report) -> None:
    report.add(
        "python",
        "ok" if sys.version_info >= (3, 11) else "error",
        f"{platform.python_implementation()} {platform.python_version()} ({sys.executable}); "
        f"{platform.system()} {platform.machine()}",
        fix=None if sys.version_info >= (3, 11) else "use Python 3.11 or newer",
    )


def check_torch(report: Report) -> Any:
    """Import torch (recording its warnings); explain device-extension autoload failures."""
    npu_version = _dist_version("torch_npu") or _dist_version("torch-npu")
    autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch
        except Exception as exc:
            torch = None
            failure = f"{type(exc).__name__}: {exc}"
            if exc.__cause__ is not None:
                failure += f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})"
    if torch is None:
        is_autoload = "backend extension" in failure or "AUTOLOAD" in failure
        report.add(
            "torch",
            "error",
            f"import torch failed: {failure}",
            fix=AUTOLOAD_FIX if is_autoload else "pip install -c constraints.txt torch",
        )
        if npu_version:
            report.add(
                "torch_npu",
                "error",
                f"torch_npu {npu_version} is installed but cannot load, and torch's device "
                f"autoload makes that break `import torch` itself",
                fix=AUTOLOAD_FIX,
            )
        return None
    build = "CPU"
    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    debug = ", debug build" if torch.version.debug else ""
    report.add("torch", "ok", f"{torch.__version__} ({build} build{debug})")
    for warning in caught:
        text = str(warning.message).splitlines()[0].split(" (Triggered internally")[0]
        fix = "pip install -c constraints.txt numpy" if "NumPy" in text else None
        report.add("torch import", "warn", f"import torch warned: {text}", fix=fix)
    if npu_version:
        if autoload:
            report.add("torch_npu", "ok", f"torch_npu {npu_version} autoloaded with torch")
        else:
            report.add(
                "torch_npu",
                "info",
                f"torch_npu {npu_version} installed; autoload is off "
                f"(TORCH_DEVICE_BACKEND_AUTOLOAD=0): `import torch_npu` to use the NPU",
            )
    return torch


def check_devices(report: Report, torch: Any) -> None:
    found = []
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        found.append(f"cuda x{torch.cuda.device_count()} ({', '.join(sorted(names))})")
    for kind in ("xpu", "mps", "npu"):
        module = getattr(torch, kind, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            found.append(kind)
    detail = ", ".join(found) if found else "none; CPU only (accelerator paths stay unused)"
    report.add("devices", "ok" if found else "info", f"accelerators: {detail}")


def check_mindspore(report: Report) -> None:
    version = _dist_version("mindspore")
    if version is None:
        report.add("mindspore", "info", "not installed (optional: the MindSpore frontend)")
    elif importlib.util.find_spec("mindspore") is None:
        report.add("mindspore", "warn", f"distribution {version} is installed but not importable")
    else:
        report.add("mindspore", "ok", f"{version} installed (imported only by its adapter)")


def _version_line(command: str) -> str:
    """The line of ``command --version`` that carries the version (nvcc puts it last)."""
    try:
        out = subprocess.run(
            [command, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"present but `{command} --version` failed: {exc}"
    lines = (out.stdout or out.stderr).strip().splitlines()
    release = [ln for ln in lines if "release" in ln]
    return (release or lines or ["unknown version"])[0]


def check_compilers(report: Report) -> None:
    cxx = [c for c in ("g++", "c++", "clang++") if shutil.which(c)]
    for name in ("gcc", "g++", "clang++", "nvcc"):
        if shutil.which(name):
            report.add(f"compiler {name}", "ok", _version_line(name))
    if not cxx:
        report.add(
            "C++ compiler",
            "warn",
            "no C++ compiler on PATH: torch.compile's CPU backend (Inductor) and spore-kernels' "
            "C++ build need one",
            fix="install g++ (e.g. `apt-get install g++`) or set CXX",
        )


def check_threads(report: Report, torch: Any) -> None:
    cores = len(usable_cores())
    shown = ", ".join(f"{k}={v}" for k, v in runtime_environment().items()) or "none set"
    threads = torch.get_num_threads() if torch is not None else None
    detail = f"{cores} usable cores; torch threads: {threads}; runtime environment: {shown}"
    if threads is not None and cores and threads > cores:
        report.add(
            "threads",
            "warn",
            detail,
            fix=f"oversubscribed: set OMP_NUM_THREADS={cores} (or fewer per rank)",
        )
    else:
        report.add("threads", "info", detail)


def check_plugins(report: Report, infos: list[PluginInfo]) -> None:
    """One line per third-party plugin: failures are errors, incompatibles warnings."""
    levels = {"active": "ok", "disabled": "info", "incompatible": "warn", "failed": "error"}
    third_party = [i for i in infos if not i.builtin]
    if not third_party:
        report.add("plugins", "info", "no plugins installed")
    for info in third_party:
        status = info.status.value if info.status else "failed"
        detail = f"{info.distribution} {info.version}: {status}"
        report.add(
            f"plugin {info.name}",
            levels[status],
            f"{detail} ({info.reason})" if info.reason else detail,
            fix="see `spore plugins check` for the full cause" if status == "failed" else None,
        )


def check_plugin_error(report: Report, error: PluginError) -> None:
    """An error check for a plugin error, with its cause."""
    cause = f" (cause: {error.__cause__!r})" if error.__cause__ else ""
    report.add("plugin error", "error", f"{error}{cause}")


def check_selection(report: Report, notes: list[str]) -> None:
    """A warning for each note loading made on the plugin selection (a name in
    ``SPORE_DISABLE_PLUGINS`` that is no installed plugin)."""
    for note in notes:
        report.add("plugin selection", "warn", note)


def clone_warmup(clones: int = WARMUP_CLONES, mib: int = 128) -> dict[str, list[float]]:
    """Minor page faults and milliseconds of each of ``clones`` clones of a ``mib`` MiB tensor,
    measured in this process (each clone freed before the next)."""
    import torch

    source = torch.ones(mib << 18)
    faults: list[float] = []
    millis: list[float] = []
    for _ in range(clones):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        copy = source.clone()
        millis.append(round((time.perf_counter() - start) * 1e3, 1))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del copy
    return {"faults": faults, "ms": millis}


def measure_warmup(env: Mapping[str, str]) -> dict[str, list[float]]:
    """:func:`clone_warmup` in a new child process with environment ``env``."""
    from spore import childproc

    code = "import json; from spore.doctor import clone_warmup; print(json.dumps(clone_warmup()))"
    return childproc.run_json(childproc.python("-c", code), env=env, timeout=300)


def describe_warmup(warmup: Mapping[str, list[float]]) -> tuple[str, bool]:
    """A sentence on a :func:`clone_warmup` measurement; true when clones 2.. took no new
    pages."""
    faults, millis = warmup["faults"], warmup["ms"]
    last = len(faults)
    faulted = [i + 1 for i, count in enumerate(faults) if i and count > WARMUP_FAULTS]
    first = (
        f"in a new process the first of {last} clones of a 128 MiB tensor page-faults "
        f"{faults[0]:.0f} times ({millis[0]:.0f} ms)"
    )
    if not faulted:
        return (
            f"{first}, clones 2-{last} take no new pages ({max(faults[1:]):.0f} faults, "
            f"at most {max(millis[1:]):.0f} ms each)",
            True,
        )
    return (
        f"{first}, and {len(faulted)} of clones 2-{last} take new pages too (the last: clone "
        f"{faulted[-1]}; at most {max(millis[1:]):.0f} ms each): freed blocks are not reused "
        f"at once",
        False,
    )


def check_allocator(report: Report) -> None:
    """Measure the fresh-allocation penalty here, what ``spore run`` would gain, and whether a
    new process under those settings reuses freed blocks from its second allocation on."""
    from spore._workloads import measure, run_workload
    from spore.runtime import RuntimeConfigError, allocator_in_use, cpu_plan

    fresh = measure("fresh", iters=5)["seconds"]
    reused = measure("reused", iters=5)["seconds"]
    penalty = fresh / reused
    current = allocator_in_use()
    detail = (
        f"allocator {current}: a fresh 128 MiB tensor costs {fresh * 1e3:.1f} ms, a copy into a "
        f"reused buffer {reused * 1e3:.1f} ms ({penalty:.1f}x)"
    )
    if penalty < 2:
        try:
            warmup, settled = describe_warmup(measure_warmup(os.environ))
        except RuntimeError as exc:
            report.add("allocator", "warn", f"{detail}; could not measure a new process: {exc}")
            return
        report.add(
            "allocator",
            "ok" if settled else "warn",
            f"{detail}; {warmup}",
            fix=None if settled else WARMUP_FIX,
        )
        return
    try:
        plan = cpu_plan(allocator="auto")
        tuned = run_workload("fresh", plan.env)["seconds"]
        warmup, settled = describe_warmup(measure_warmup(plan.env))
    except (RuntimeConfigError, RuntimeError, OSError) as exc:
        report.add("allocator", "warn", f"{detail}; could not measure a tuned child: {exc}")
        return
    exports = " ".join(f"{k}={v}" for k, v in plan.set.items() if not k.endswith("_THREADS"))
    report.add(
        "allocator",
        "warn",
        f"{detail}; under `spore run` (allocator {plan.allocator}) the fresh tensor costs "
        f"{tuned * 1e3:.1f} ms here ({fresh / tuned:.1f}x faster) and {warmup}. Trade-off: "
        f"freed memory is kept for reuse, so resident memory stays higher",
        fix=f"start CPU jobs with `spore run -- CMD`, or export {exports}",
    )
