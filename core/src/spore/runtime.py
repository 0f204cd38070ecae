"""CPU runtime settings: allocator and threads, chosen before a process starts.

On glibc, every allocation above the mmap threshold (dynamic, at most 32 MiB) is a fresh
``mmap`` that page-faults on first touch and is unmapped on free, so eager PyTorch on large
tensors pays the page faults on every op. The ``tuned`` allocator keeps such blocks in the heap
for reuse (glibc's own tunables, no extra library): resident memory stays higher in exchange.
It also keeps glibc's per-thread cache (tcache) to the smallest chunks: PyTorch allocates with
``posix_memalign``, whose alignment slivers would otherwise sit in the tcache between a freed
block and its neighbours, so about seven freed blocks were stranded before they merged and were
reused (the first clones of a 128 MiB tensor each page-faulted 32768 times).

``cpu_plan``/``cpu_env`` compute the environment; ``spore run``, ``spore bench`` and launchers
apply it. Variables the user already set are never overwritten: they are kept and reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

RUNTIME_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "GLIBC_TUNABLES")
APPLIED_MARKER = "SPORE_RUNTIME"
"""Set in a planned child to the allocator chosen, so a launcher does not apply a plan twice."""

GLIBC_TUNED = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(512 << 20),
}
TUNED_TUNABLES = {"glibc.malloc.tcache_max": "0"}
"""Entries the tuned allocator adds to ``GLIBC_TUNABLES``: the tcache keeps only chunks of
requests up to 24 bytes, so ``posix_memalign``'s slivers (48 bytes and up) merge at once."""
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,dirty_decay_ms:-1,muzzy_decay_ms:-1"
ALLOCATORS = ("auto", "tuned", "system", "jemalloc", "tcmalloc")
_LIBRARIES = {"jemalloc": "libjemalloc.so", "tcmalloc": "libtcmalloc.so"}
_INSTALL_HINT = {
    "jemalloc": "apt-get install libjemalloc2",
    "tcmalloc": "apt-get install libgoogle-perftools4",
}


class RuntimeConfigError(ValueError):
    """An allocator or thread setting that cannot be applied here."""


def runtime_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that change CPU thread and allocator behaviour, sorted."""
    env = os.environ if env is None else env
    return {
        k: v
        for k, v in sorted(env.items())
        if k in RUNTIME_VARIABLES or k.startswith("MALLOC_") or k == APPLIED_MARKER
    }


def parse_tunables(value: str) -> dict[str, str]:
    """``GLIBC_TUNABLES``' ``name=value:name=value`` list as a dict, in order."""
    return dict(item.partition("=")[::2] for item in value.split(":") if item)


def join_tunables(tunables: Mapping[str, str]) -> str:
    """The ``GLIBC_TUNABLES`` value for ``tunables``."""
    return ":".join(f"{name}={value}" for name, value in tunables.items())


def allocator_in_use(env: Mapping[str, str] | None = None) -> str:
    """Which allocator settings ``env`` carries: tuned, jemalloc, tcmalloc, custom or system."""
    env = os.environ if env is None else env
    preload = env.get("LD_PRELOAD", "")
    for name, lib in _LIBRARIES.items():
        if lib in preload:
            return name
    tunables = parse_tunables(env.get("GLIBC_TUNABLES", ""))
    if all(env.get(k) == v for k, v in GLIBC_TUNED.items()) and all(
        tunables.get(k) == v for k, v in TUNED_TUNABLES.items()
    ):
        return "tuned"
    if any(k.startswith("MALLOC_") for k in env) or any(
        k.startswith("glibc.malloc.") for k in tunables
    ):
        return "custom"
    return "system"


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask where the OS exposes one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def find_library(allocator: str) -> str | None:
    """The path of the jemalloc/tcmalloc shared library, if the dynamic linker knows one."""
    prefix = _LIBRARIES[allocator]
    try:
        listing = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    paths = [ln.split("=>")[-1].strip() for ln in listing.splitlines() if prefix in ln]
    return sorted(paths)[0] if paths else None


@dataclass
class RuntimePlan:
    """The environment for a tuned child process and what was decided about each variable."""

    allocator: str
    threads: int
    cores: list[int]
    env: dict[str, str]
    set: dict[str, str] = field(default_factory=dict)
    kept: dict[str, tuple[str, str]] = field(default_factory=dict)
    replaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def describe(self) -> list[str]:
        """One line per variable: what was set (over which user values), and which user values
        were kept."""
        lines = [f"set {k}={v}" for k, v in self.set.items() if k not in self.replaced]
        lines += [
            f"set {k}={ours} (your {theirs} replaced: threads were asked for)"
            for k, (ours, theirs) in self.replaced.items()
        ]
        lines += [
            f"kept your {k}={theirs} (spore would set {ours})"
            for k, (ours, theirs) in self.kept.items()
        ]
        return lines


def cpu_plan(
    *,
    allocator: str = "auto",
    threads: int | None = None,
    ranks: int = 1,
    rank: int = 0,
    affinity: bool = False,
    base_env: Mapping[str, str] | None = None,
) -> RuntimePlan:
    """Plan the environment of a CPU process, one of ``ranks`` local ranks.

    ``allocator``: ``auto`` (tcmalloc when the dynamic linker has it, else ``tuned``),
    ``tuned`` (glibc tunables; :data:`TUNED_TUNABLES` join the user's ``GLIBC_TUNABLES``),
    ``jemalloc``/``tcmalloc`` (preloaded; an error when missing) or ``system`` (nothing changed).

    ``threads``, when given, sets ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` over the
    environment's; it defaults to the environment's ``OMP_NUM_THREADS`` (kept: MKL gets as
    many), else to this process's usable cores divided between the ranks (at least 1);
    ``affinity`` pins rank ``rank`` to its own slice of cores through OpenMP places.
    """
    if allocator not in ALLOCATORS:
        raise RuntimeConfigError(
            f"unknown allocator {allocator!r}; choose one of {', '.join(ALLOCATORS)}"
        )
    for name, value in (("threads", threads), ("ranks", ranks), ("rank", rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RuntimeConfigError(f"{name} must be an int, got {value!r}")
    if ranks < 1 or not 0 <= rank < ranks:
        raise RuntimeConfigError(f"rank {rank} of {ranks} ranks: need 0 <= rank < ranks >= 1")
    if threads is not None and threads < 1:
        raise RuntimeConfigError(f"threads must be >= 1, got {threads}")
    base = dict(os.environ if base_env is None else base_env)
    all_cores = usable_cores()
    share = max(1, len(all_cores) // ranks)
    asked = {"OMP_NUM_THREADS", "MKL_NUM_THREADS"} if threads is not None else set()
    threads = threads or _positive_int(base.get("OMP_NUM_THREADS", "")) or share
    mine = [all_cores[(rank * share + i) % len(all_cores)] for i in range(share)]
    wanted: dict[str, str] = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    path = None
    if allocator == "auto":
        path = find_library("tcmalloc")
        allocator = "tcmalloc" if path else "tuned"
    elif allocator in _LIBRARIES:
        path = find_library(allocator)
    if allocator == "tuned":
        wanted |= GLIBC_TUNED
        theirs = parse_tunables(base.get("GLIBC_TUNABLES", ""))
        wanted["GLIBC_TUNABLES"] = join_tunables(theirs | TUNED_TUNABLES)
        if not theirs.keys() & TUNED_TUNABLES.keys():
            base.pop("GLIBC_TUNABLES", None)
    elif allocator in _LIBRARIES:
        if path is None:
            raise RuntimeConfigError(
                f"--allocator {allocator}: no {_LIBRARIES[allocator]} found by the dynamic "
                f"linker; install it ({_INSTALL_HINT[allocator]}) or use --allocator tuned"
            )
        preload = base.get("LD_PRELOAD", "")
        wanted["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
        base.pop("LD_PRELOAD", None)
        if allocator == "jemalloc":
            wanted["MALLOC_CONF"] = JEMALLOC_CONF
    if affinity:
        wanted["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in mine)
        wanted["OMP_PROC_BIND"] = "close"
    plan = RuntimePlan(allocator, threads, mine, dict(base))
    for key, value in wanted.items():
        if key in asked and base.get(key, value) != value:
            plan.replaced[key] = (value, base[key])
            plan.set[key] = value
            plan.env[key] = value
        elif key in base and base[key] != value:
            plan.kept[key] = (value, base[key])
        elif key not in base:
            plan.set[key] = value
            plan.env[key] = value
    plan.env[APPLIED_MARKER] = allocator
    return plan


def _positive_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdecimal() and int(text) > 0 else None


def cpu_env(
    *,
    allocator: str = "auto",
    threads: int | None = None,
    ranks: int = 1,
    rank: int = 0,
    affinity: bool = False,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment :func:`cpu_plan` computes, for launchers."""
    plan = cpu_plan(
        allocator=allocator,
        threads=threads,
        ranks=ranks,
        rank=rank,
        affinity=affinity,
        base_env=base_env,
    )
    return plan.env


def restart_tuned() -> None:
    """Re-run this Python command (as started: interpreter options, ``-m`` or ``-c`` kept) under
    :func:`cpu_env` (the runtime ``spore bench`` measures under) unless a runtime plan is
    applied already: for a tool whose timings are read beside ``spore bench``'s figures. Does
    not return when it restarts."""
    if APPLIED_MARKER not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], cpu_env())


def system_env(base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base_env`` back on glibc's malloc defaults: no ``MALLOC_*`` variables or
    ``glibc.malloc.*`` tunables, no preloaded jemalloc/tcmalloc."""
    base = os.environ if base_env is None else base_env
    env = {k: v for k, v in base.items() if not k.startswith("MALLOC_") and k != APPLIED_MARKER}
    tunables = {
        k: v
        for k, v in parse_tunables(env.pop("GLIBC_TUNABLES", "")).items()
        if not k.startswith("glibc.malloc.")
    }
    if tunables:
        env["GLIBC_TUNABLES"] = join_tunables(tunables)
    preload = [
        p
        for p in env.pop("LD_PRELOAD", "").split(":")
        if p and not any(lib in p for lib in _LIBRARIES.values())
    ]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env
