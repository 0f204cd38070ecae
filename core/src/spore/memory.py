"""Saved-tensor memory: composable saved-tensor hooks and the built-ins ``track()`` and
``offload()``; ``peak()`` measures the peak memory of the tensors a block creates.

``torch.autograd.graph.saved_tensors_hooks`` keeps only the innermost pair active. Spore's
:func:`saved_tensors_hooks` composes them: a tensor autograd saves goes through every active
``pack``, outermost first (so an inner hook receives what the outer ones packed), and back
through the ``unpack`` functions in the reverse order.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ContextDecorator, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Pack = Callable[[Any], Any]
Unpack = Callable[[Any], Any]

Entry = tuple[Pack, Unpack, bool]
"""A composed pair and whether it only observes (it then packs innermost: :func:`compose`)."""


def compose(entries: list[Entry]) -> tuple[Pack, Unpack]:
    """One (pack, unpack) pair running the entries outermost-first, and back in reverse; the
    observers after the others, so that a hook that transforms sees the tensors themselves
    wherever an observer sits."""
    ordered = [e for e in entries if not e[2]] + [e for e in entries if e[2]]
    chain = [(pack, unpack) for pack, unpack, _ in ordered]

    def pack_all(value: Any) -> Any:
        for p, _ in chain:
            value = p(value)
        return value

    def unpack_all(value: Any) -> Any:
        for _, u in reversed(chain):
            value = u(value)
        return value

    pack_all._spore_entries = entries  # type: ignore[attr-defined]
    return pack_all, unpack_all


@contextmanager
def stacked(
    pack: Pack,
    unpack: Unpack,
    install: Callable[[Pack, Unpack], Any],
    active: Callable[[], tuple[Pack, Unpack] | None],
    *,
    observes: bool = False,
) -> Iterator[None]:
    """Install with ``install`` the pair (pack, unpack) composed with ``active()``, the pair the
    framework runs now: with the entries of a pair composed here, or with one installed without
    Spore (torch's checkpoint) as the outermost entry, since it shadows the entries outside it."""
    top = active()
    below = [] if top is None else getattr(top[0], "_spore_entries", [(*top, False)])
    with install(*compose([*below, (pack, unpack, observes)])):
        yield


def _torch_active() -> tuple[Pack, Unpack] | None:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


class SavedTensorsHooks(ContextDecorator):
    """A (pack, unpack) pair added on top of the active ones in each block it is entered (see
    module doc). As torch's ``saved_tensors_hooks``, one object can be entered again, after
    its block or inside it, and from several threads: each entry composes with the pairs
    active there and then. As a decorator, each call of the function is such a block.

    .. versionadded:: 0.1.0
    """

    def __init__(self, pack: Pack, unpack: Unpack) -> None:
        self.pack_hook, self.unpack_hook = pack, unpack  # torch's attribute names
        self._entries = threading.local()

    def _open(self) -> list[AbstractContextManager[None]]:
        """The entries of this object still open on the calling thread, innermost last."""
        if not hasattr(self._entries, "open"):
            self._entries.open = []
        return self._entries.open

    def __enter__(self) -> None:
        entry = stacked(self.pack_hook, self.unpack_hook, self._install, self._active)
        entry.__enter__()
        self._open().append(entry)

    def __exit__(self, *exc_info: Any) -> None:
        self._open().pop().__exit__(*exc_info)

    @staticmethod
    def _install(pack: Pack, unpack: Unpack) -> AbstractContextManager[None]:
        """The framework's own hooks context for the composed pair (a frontend overrides it)."""
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @staticmethod
    def _active() -> tuple[Pack, Unpack] | None:
        """The pair the framework runs now (a frontend overrides it, with ``_install``)."""
        return _torch_active()


def saved_tensors_hooks(pack: Pack, unpack: Unpack) -> SavedTensorsHooks:
    """Add a (pack, unpack) pair on top of the active ones for the block (see module doc)."""
    return SavedTensorsHooks(pack, unpack)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# track -----------------------------------------------------------------------------------------
@dataclass
class OpSaved:
    """Saved tensors attributed to one torch function."""

    count: int = 0
    bytes: int = 0


@dataclass
class SavedTensorTracker:
    """What :func:`track` counted: tensors autograd saved, their bytes, per op and at peak.

    ``live_bytes`` falls again as autograd frees what it saved (after backward);
    ``peak_bytes`` is its maximum. Values that are not tensors (packed by another active hook,
    e.g. offloaded to disk) count in ``count`` and ``packed_elsewhere`` but not in bytes.
    """

    count: int = 0
    bytes: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0
    packed_elsewhere: int = 0
    by_op: dict[str, OpSaved] = field(default_factory=dict)

    def _add(self, op: str, nbytes: int) -> None:
        entry = self.by_op.setdefault(op, OpSaved())
        entry.count += 1
        entry.bytes += nbytes
        self.count += 1
        self.bytes += nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


class _CurrentOp(TorchFunctionMode):
    """Names the torch function running, so a pack can be attributed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", str(func)))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.names.pop()


class _Held:
    """What track() packs: the tensor detached (the tensor itself would make a cycle through
    its own grad_fn when autograd saves an op's output, which the garbage collector cannot
    see through), so its release can be observed; and its version, checked in backward as
    autograd checks it without hooks."""

    __slots__ = ("__weakref__", "value", "version")

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value.detach()
        self.version = _version(value)

    def unpack(self) -> torch.Tensor:
        _check_version(self.value, self.version, "spore.memory.track()")
        return self.value


def _check_version(t: torch.Tensor, saved: int | None, who: str) -> None:
    """Raise as autograd does without hooks when ``t`` changed in place after it was saved at
    version ``saved`` (``None``: not known)."""
    if saved is not None and _version(t) != saved:
        raise RuntimeError(
            f"a tensor autograd saved ({_describe(t)}) was modified by an inplace operation "
            f"after it was saved: its version is {_version(t)}, it was saved at {saved} ({who} "
            "checks this as autograd does without hooks); clone it before modifying it"
        )


def _version(t: torch.Tensor) -> int | None:
    """``t._version``, ``None`` where a tensor has none (inference tensors, some subclasses)."""
    try:
        return t._version
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


@contextmanager
def track() -> Iterator[SavedTensorTracker]:
    """Count the tensors autograd saves inside the block, per torch function and at peak. It
    observes whatever other hooks are active, inside or outside it: it sees what they pack."""
    tracker = SavedTensorTracker()
    current = _CurrentOp()

    def pack(value: Any) -> Any:
        op = current.names[-1] if current.names else "<autograd>"
        if not isinstance(value, torch.Tensor):
            tracker.count += 1
            tracker.packed_elsewhere += 1
            return value
        held = _Held(value)
        nbytes = _nbytes(value)
        tracker._add(op, nbytes)
        weakref.finalize(held, tracker._release, nbytes)
        return held

    def unpack(value: Any) -> Any:
        return value.unpack() if isinstance(value, _Held) else value

    install = torch.autograd.graph.saved_tensors_hooks
    with stacked(pack, unpack, install, _torch_active, observes=True), current:
        yield tracker


# offload ---------------------------------------------------------------------------------------
@dataclass
class OffloadStats:
    """What :func:`offload` moved: tensors and bytes, and how many it kept in memory."""

    offloaded: int = 0
    offloaded_bytes: int = 0
    kept: int = 0


class _OnDisk:
    """A saved tensor spilled to a file, its elements in their memory order, so that it comes
    back with its strides (channels_last, transposed); the file is removed when autograd drops
    the handle, or at once when writing it fails. The tensor's version is checked on load as
    autograd checks it, while the tensor is alive to tell."""

    __slots__ = ("__weakref__", "dtype", "numel", "path", "shape", "source", "stride", "version")

    def __init__(self, tensor: torch.Tensor, directory: str) -> None:
        self.path = os.path.join(directory, f"spore-saved-{uuid.uuid4().hex}.bin")
        self.shape, self.stride = tensor.shape, tensor.stride()
        self.dtype, self.numel = tensor.dtype, tensor.numel()
        # a view's version is its base's, which outlives it (the saved view object does not)
        owner = tensor._base if tensor._base is not None else tensor
        self.source, self.version = weakref.ref(owner), _version(tensor)
        finalizer = weakref.finalize(self, _unlink, self.path)
        try:
            mapped = torch.from_file(self.path, shared=True, size=self.numel, dtype=self.dtype)
            mapped.copy_(_memory_order(tensor))
            del mapped  # unmapped: the pages now belong to the page cache, not to this process
        except BaseException:
            finalizer()
            raise

    def load(self) -> torch.Tensor:
        source = self.source()
        if source is not None:
            _check_version(source, self.version, "spore.memory.offload()")
        data = torch.from_file(self.path, shared=False, size=self.numel, dtype=self.dtype)
        return data.as_strided(self.shape, self.stride)


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` (non-overlapping and dense) in the order they lie in memory."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _unlink(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


class _OnHost:
    """A CUDA tensor copied to pinned host memory on a side stream."""

    def __init__(self, tensor: torch.Tensor, stream: Any) -> None:
        self.device = tensor.device
        self.host = torch.empty(
            tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=True
        )
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            self.host.copy_(tensor, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        tensor.record_stream(stream)
        self.back: torch.Tensor | None = None
        self.index = 0

    def prefetch(self, stream: Any) -> None:
        if self.back is None:
            with torch.cuda.stream(stream):
                stream.wait_event(self.copied)
                self.back = self.host.to(self.device, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(stream)

    def load(self, stream: Any) -> torch.Tensor:
        """The device copy, handed over: autograd frees it with the node that used it (the
        pinned copy stays, for a graph unpacked again)."""
        self.prefetch(stream)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        back, self.back = self.back, None
        assert back is not None
        back.record_stream(current)  # made on the side stream, freed after the reads here
        return back


def _offloadable(value: Any, device_type: str, min_bytes: int) -> bool:
    """A plain dense tensor of its own memory (not a subclass, a nested tensor, an expanded or
    sliced view, whose copy would not free its storage or would be larger), not a parameter
    or a view of one (``weight.t()``), which stays resident anyway."""
    if type(value) is not torch.Tensor or value.is_nested:
        return False
    base = value._base if value._base is not None else value
    return (
        value.device.type == device_type
        and value.layout == torch.strided
        and _nbytes(value) >= min_bytes
        and _dense(value)
        and _nbytes(value) == value.untyped_storage().nbytes()  # not a slice of a larger one
        and not (base.is_leaf and base.requires_grad)
    )


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers a block of memory once, without gaps or repeats: its dims of size
    above 1, ordered by stride, are contiguous (expanded and sliced views are not)."""
    if t.numel() == 0:
        return False
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


@contextmanager
def offload(
    target: str = "auto",
    *,
    min_bytes: int = 1 << 20,
    directory: str | None = None,
    prefetch: int = 2,
) -> Iterator[OffloadStats]:
    """Move saved activations of at least ``min_bytes`` out of memory until backward needs them.

    ``target="disk"``: CPU tensors are written to files in ``directory`` (default: the temp
    dir) and mapped back on demand in backward, so they stop counting in resident memory.
    ``target="host"``: CUDA tensors are copied to pinned host memory on a side stream; in
    backward each one and the next ``prefetch`` are copied back ahead of use.
    ``"auto"``: ``host`` when CUDA is available, else ``disk``. Parameters are never moved.
    """
    if target == "auto":
        target = "host" if torch.cuda.is_available() else "disk"
    if target not in ("disk", "host"):
        raise ValueError(f"offload target must be 'disk', 'host' or 'auto', got {target!r}")
    if target == "host" and not torch.cuda.is_available():
        raise RuntimeError("offload(target='host') needs CUDA; use target='disk' on CPU")
    if min_bytes < 0:
        raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
    stats = OffloadStats()
    folder = os.path.abspath(directory or tempfile.gettempdir())  # as at pack, whatever cwd
    if target == "disk" and not os.path.isdir(folder):
        raise NotADirectoryError(
            f"offload directory {folder!r} is not a directory: create it, or pass "
            "directory=None for the temp dir"
        )
    if target == "disk" and not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"offload directory {folder!r} is not writable")
    stream = torch.cuda.Stream() if target == "host" else None
    order: weakref.WeakValueDictionary[int, _OnHost] = weakref.WeakValueDictionary()
    count = itertools.count()  # a handle's place: those packed before it unpack after it

    def pack(value: Any) -> Any:
        if not _offloadable(value, "cpu" if target == "disk" else "cuda", min_bytes):
            stats.kept += 1
            if not isinstance(value, torch.Tensor):
                return value
            kept = value.detach()  # a tensor still, for the hooks around (track counts it)
            kept._spore_saved_version = _version(value)
            return kept
        stats.offloaded += 1
        stats.offloaded_bytes += _nbytes(value)
        if target == "disk":
            return _OnDisk(value, folder)
        handle = _OnHost(value, stream)
        handle.index = next(count)
        order[handle.index] = handle  # weakly: a freed graph's handles (and pinned copies) go
        return handle

    def unpack(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            _check_version(
                value, getattr(value, "_spore_saved_version", None), "spore.memory.offload()"
            )
            return value
        if isinstance(value, _OnDisk):
            return value.load()
        if isinstance(value, _OnHost):
            for at in range(max(0, value.index - prefetch), value.index):
                if (earlier := order.get(at)) is not None:
                    earlier.prefetch(stream)
            return value.load(stream)
        return value

    with saved_tensors_hooks(pack, unpack):
        yield stats


# peak ------------------------------------------------------------------------------------------
@dataclass
class PeakMemory:
    """What :func:`peak` measured, in bytes.

    ``peak_bytes``: the most memory the tensors created inside the block held at once.
    ``live_bytes``: what they hold now (on CPU it keeps falling after the block as they are
    freed; on CUDA it is read when the block ends).
    """

    device: str
    peak_bytes: int = 0
    live_bytes: int = 0


class _StorageMeter(TorchDispatchMode):
    """Adds each new output storage of ``device_type`` once; a finalizer subtracts it on free."""

    def __init__(self, record: PeakMemory, device_type: str) -> None:
        super().__init__()
        self.record = record
        self.device_type = device_type
        self.sizes: dict[int, int] = {}  # bytes counted per storage
        self.before: dict[int, int] = {}  # the size of a storage from before the block
        self.lock = threading.Lock()

    def _change(self, key: int, nbytes: int, freed: bool = False) -> None:
        with self.lock:
            delta = nbytes - self.sizes.get(key, 0)
            if freed:
                self.sizes.pop(key, None)
                self.before.pop(key, None)
            else:
                self.sizes[key] = nbytes
            self.record.live_bytes += delta
            self.record.peak_bytes = max(self.record.peak_bytes, self.record.live_bytes)

    def _metered(self, tensor: Any) -> bool:
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.device.type == self.device_type
            and tensor.layout == torch.strided
        )

    def _see(self, tensor: torch.Tensor, inputs: dict[int, int]) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        known = self.sizes.get(key)
        if known is None:
            if key in inputs:  # an in-place or ``out=`` result in memory from before the block
                if nbytes <= inputs[key]:
                    return
                self.before[key] = inputs[key]  # grown (``resize_``): the growth counts
            weakref.finalize(storage, self._change, key, 0, True)
        counted = max(0, nbytes - self.before.get(key, 0))
        if known != counted:  # new, or resized in place (``out=``, ``resize_``)
            self._change(key, counted)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        storages = [t.untyped_storage() for t in tree_leaves((args, kwargs)) if self._metered(t)]
        inputs = {storage._cdata: storage.nbytes() for storage in storages}
        out = func(*args, **kwargs)
        for value in tree_leaves(out):
            if self._metered(value):
                self._see(value, inputs)
        return out


@contextmanager
def peak(device: str | torch.device = "cpu") -> Iterator[PeakMemory]:
    """Measure the peak memory of the tensors created inside the block on ``device``.

    CPU (and any device without an allocator's statistics): every op's outputs are seen by a
    ``TorchDispatchMode``; each new storage adds its bytes once (views and in-place results
    share it) and a finalizer subtracts them when the storage is freed, so what autograd saves
    counts until backward releases it. Memory a kernel allocates without returning it as a
    tensor (its scratch) is not seen, nor the temporaries of an op whose kernel is Python code
    (a ``torch.library`` custom op runs below the mode as one op). CUDA: the caching allocator's
    ``max_memory_allocated`` above what was allocated when the block began (tensors freed
    inside the block that were created before it can lower that base; scratch counts).
    """
    dev = torch.device(device)
    record = PeakMemory(str(dev))
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(index)
        base = torch.cuda.memory_allocated(index)
        torch.cuda.reset_peak_memory_stats(index)
        try:
            yield record
        finally:
            torch.cuda.synchronize(index)
            record.peak_bytes = max(0, torch.cuda.max_memory_allocated(index) - base)
            record.live_bytes = torch.cuda.memory_allocated(index) - base
        return
    with _StorageMeter(record, dev.type):
        yield record
