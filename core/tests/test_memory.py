from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from contextlib import nullcontext

import pytest
import torch

import spore
from spore import memory
from spore.runtime import system_env


def _step(x, w1, w2):
    return (torch.nn.functional.gelu(x @ w1) @ w2).sum()


def _params(seed=0, n=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g, requires_grad=True)
    w1 = torch.randn(32, 128, generator=g, requires_grad=True)
    w2 = torch.randn(128, 8, generator=g, requires_grad=True)
    return x, w1, w2


def _grads(context=None):
    x, w1, w2 = _params()
    if context is None:
        loss = _step(x, w1, w2)
    else:
        with context:
            loss = _step(x, w1, w2)
    loss.backward()
    return [t.grad for t in (x, w1, w2)]


def _bitwise_equal(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_hooks_compose_outer_first_and_unpack_in_reverse() -> None:
    events = []

    def pack(tag):
        def run(value):
            events.append(f"pack {tag} <- {type(value).__name__}")
            return (tag, value)

        return run

    def unpack(tag):
        def run(value):
            got, inner = value
            assert got == tag
            events.append(f"unpack {tag}")
            return inner

        return run

    x = torch.randn(3, requires_grad=True)
    with spore.saved_tensors_hooks(pack("outer"), unpack("outer")):
        with spore.saved_tensors_hooks(pack("inner"), unpack("inner")):
            y = x.exp()
        z = y.sin()
    (y.sum() + z.sum()).backward()
    assert events == [
        "pack outer <- Tensor",  # exp saves its result: outer packs first,
        "pack inner <- tuple",  # the inner hook receives what the outer packed
        "pack outer <- Tensor",  # sin ran with the outer hooks only
        "unpack outer",  # backward: sin first
        "unpack inner",  # then exp: inner unpacks first,
        "unpack outer",  # the outer last
    ]
    plain = x.detach().clone().requires_grad_()
    plain_y = plain.exp()
    (plain_y.sum() + plain_y.sin().sum()).backward()
    assert torch.equal(x.grad, plain.grad)


def test_one_hooks_object_is_entered_again_as_torchs_is() -> None:
    packed: list[str] = []
    outer = spore.saved_tensors_hooks(lambda t: packed.append("outer") or t, lambda t: t)
    inner = spore.saved_tensors_hooks(lambda t: packed.append("inner") or t, lambda t: t)
    x = torch.randn(3, requires_grad=True)
    for _ in range(2):  # one object per training loop, entered each step
        with outer:
            x.exp().sum().backward()
    assert packed == ["outer", "outer"]
    packed.clear()
    with outer, inner:
        with inner:  # inside its own block: composed once more
            x.exp().sum().backward()
        x.sin().sum().backward()
    assert packed == ["outer", "inner", "inner", "outer", "inner"]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_hooks_object_decorates_a_function_each_call_a_block() -> None:
    """It decorated functions as a generator context manager does; the reusable object
    raised ``TypeError: 'SavedTensorsHooks' object is not callable``."""
    packed: list[str] = []

    @spore.saved_tensors_hooks(lambda t: packed.append("pack") or t, lambda t: t)
    def loss(x: torch.Tensor) -> torch.Tensor:
        return x.exp().sum()

    x = torch.randn(3, requires_grad=True)
    for _ in range(2):
        loss(x).backward()
    assert packed == ["pack", "pack"]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_gradients_are_bitwise_identical_with_hooks() -> None:
    plain = _grads()
    assert _bitwise_equal(plain, _grads(spore.saved_tensors_hooks(lambda t: t, lambda t: t)))
    assert _bitwise_equal(plain, _grads(memory.offload("disk", min_bytes=0)))


def test_track_counts_bytes_per_op_and_peak() -> None:
    x, w1, w2 = _params()
    with memory.track() as tracked:
        loss = _step(x, w1, w2)
    assert tracked.count > 0
    assert tracked.by_op["gelu"].bytes == 64 * 128 * 4
    assert tracked.by_op["matmul"].count == 4  # each matmul saves both inputs
    assert tracked.bytes == sum(op.bytes for op in tracked.by_op.values())
    assert tracked.peak_bytes == tracked.bytes == tracked.live_bytes
    loss.backward()
    del loss
    assert tracked.live_bytes == 0
    assert tracked.peak_bytes == tracked.bytes


@pytest.mark.parametrize("hooks", ["track", "offload"])
def test_graphs_dropped_without_backward_free_what_they_saved(hooks, tmp_path) -> None:
    x = torch.randn(1000, requires_grad=True)
    alive = []
    block = memory.track() if hooks == "track" else memory.offload("disk", directory=tmp_path)
    with block as stats:
        for _ in range(5):
            y = x.exp()  # exp saves its output: kept as it is, the output would hold itself
            z = y.exp().sum()
            alive.append(weakref.ref(y))
            del y, z
    gc.collect()
    assert [r() for r in alive] == [None] * 5
    if hooks == "track":
        assert stats.count == 10
        assert stats.live_bytes == 0


def test_track_refuses_a_saved_tensor_modified_in_place_as_autograd_does() -> None:
    x = torch.tensor([0.5, 1.0], requires_grad=True)
    with memory.track():
        a = x * 2
        b = a.sin()  # saves a
    a.add_(1)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*version is 1"):
        b.sum().backward()
    with memory.track():
        b = (x * 2).sin()
    b.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()))


def test_offload_spills_to_files_and_cleans_up(tmp_path) -> None:
    x, w1, w2 = _params(n=2048)
    with memory.offload("disk", min_bytes=1 << 20, directory=str(tmp_path)) as stats:
        loss = _step(x, w1, w2)
    files = list(tmp_path.iterdir())
    assert stats.offloaded == len(files) > 0
    assert stats.offloaded_bytes == sum(f.stat().st_size for f in files)
    assert stats.kept > 0  # the parameters and small tensors stay
    loss.backward()
    del loss
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("min_bytes", [0, 1 << 30])  # spilled, and kept in memory
def test_offload_refuses_a_saved_tensor_modified_in_place(tmp_path, min_bytes) -> None:
    """A kept tensor had no version check, a spilled one used its values from save time: the
    gradient was silently wrong where autograd raises."""
    x = torch.tensor([0.5, 1.0], requires_grad=True)
    with memory.offload("disk", min_bytes=min_bytes, directory=str(tmp_path)):
        a = x * 2
        b = a.sin()  # saves a
    a.add_(1)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*version is 1"):
        b.sum().backward()


def test_offload_checks_a_saved_view_against_its_base(tmp_path) -> None:
    """A contiguous row slice ``h[1:]`` was spilled although its storage stays resident, and a
    spilled view (``h.t()``) was checked through the view object, gone after the forward:
    ``h.add_(1)`` then went unnoticed and the gradients used the old values."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    for saves, spilled in ((lambda h: h[1:].sin(), 0), (lambda h: w @ h.t(), 1)):
        with memory.offload("disk", min_bytes=0, directory=str(tmp_path)) as stats:
            h = x * 2
            y = saves(h)
        assert stats.offloaded == spilled  # the slice stays; h.t() is h's whole storage
        h.add_(1)
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*version is 1"):
            y.sum().backward()


def test_offloaded_tensors_come_back_with_their_strides(tmp_path) -> None:
    """A channels_last activation came back contiguous: gradients 1.8e-4 off, and Inductor's
    backward failed its stride assertion."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 9, 9, generator=g).contiguous(memory_format=torch.channels_last)
    w0 = torch.randn(8, 3, 3, 3, generator=g)

    def grads(offloaded):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        spill = memory.offload("disk", min_bytes=0, directory=str(tmp_path))
        with spill if offloaded else nullcontext() as stats:
            y = torch.nn.functional.conv2d(x * 1, w, padding=1).transpose(2, 3) * 1
        (y * y).sum().backward()
        return x.grad, w.grad, stats

    (*plain, _), (*spilled, stats) = grads(False), grads(True)
    assert stats.offloaded == 1  # the conv's channels_last input (w is a leaf: kept)
    assert _bitwise_equal(plain[0], spilled[0])
    assert _bitwise_equal(plain[1], spilled[1])
    assert list(tmp_path.iterdir()) == []


def test_offload_keeps_what_a_copy_would_not_free(tmp_path) -> None:
    """Views of a parameter (``weight.t()`` of a linear) were spilled every step, an expanded
    row was written at its expanded size, and a tensor subclass came back a plain tensor."""
    linear = torch.nn.Linear(512, 512)
    row = torch.randn(1, 4096, requires_grad=True)
    with memory.offload("disk", min_bytes=0, directory=str(tmp_path)) as stats:
        y = linear(torch.randn(4, 512))  # saves the input and weight.t()
        z = row.expand(4096, 4096) * torch.randn(4096, 4096)  # saves the expanded row
        fallback = spore.FallbackTensor(torch.randn(3, requires_grad=True)).sin()
    written = sum(f.stat().st_size for f in tmp_path.iterdir())
    assert written == stats.offloaded_bytes < (4096 * 4096 + 512 * 512) * 4
    assert type(fallback.grad_fn._saved_self) is spore.FallbackTensor
    (y.sum() + z.sum()).backward()


def test_offload_outer_and_track_inner_compose() -> None:
    x, w1, w2 = _params(n=2048)
    with memory.offload("disk", min_bytes=1 << 20) as stats, memory.track() as tracked:
        _step(x, w1, w2).backward()
    assert tracked.packed_elsewhere == stats.offloaded > 0


def test_track_outer_and_offload_inner_compose() -> None:
    """track() only observes: the offload inside it offloads as alone (track's wrapper hid
    the tensors from it, and it kept them all in memory)."""
    x, w1, w2 = _params(n=2048)
    with memory.offload("disk", min_bytes=1 << 20) as alone:
        _step(x, w1, w2).backward()
    with memory.track() as tracked, memory.offload("disk", min_bytes=1 << 20) as stats:
        _step(x, w1, w2).backward()
    assert stats.offloaded == alone.offloaded > 0
    assert stats.kept == alone.kept
    assert tracked.packed_elsewhere == stats.offloaded


@pytest.mark.parametrize("hooks", ["track", "offload", "pair"])
def test_hooks_inside_torch_checkpoint_keep_it_recomputing(hooks, tmp_path) -> None:
    """A Spore pair entered inside ``torch.utils.checkpoint`` composes with the checkpoint's
    own (installed with torch's ``saved_tensors_hooks``) instead of shadowing it: the
    checkpoint still saves nothing of the block and recomputes it in backward."""
    runs = []
    packed = []

    def block(x, w1, w2):
        runs.append(1)
        context = {
            "track": memory.track(),
            "offload": memory.offload("disk", directory=tmp_path, min_bytes=0),
            "pair": spore.saved_tensors_hooks(lambda v: packed.append(v) or v, lambda v: v),
        }[hooks]
        with context as seen:
            out = _step(x, w1, w2)
        if hooks == "track":
            assert seen.bytes == 0
            assert seen.packed_elsewhere == seen.count > 0
        return out

    x, w1, w2 = _params()
    loss = torch.utils.checkpoint.checkpoint(block, x, w1, w2, use_reentrant=False)
    assert not list(tmp_path.iterdir())
    loss.backward()
    assert len(runs) == 2
    assert not any(isinstance(v, torch.Tensor) for v in packed[: len(packed) // 2])
    assert _bitwise_equal([t.grad for t in (x, w1, w2)], _grads())


def test_offload_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="offload target must be"), memory.offload("tape"):
        pass
    with pytest.raises(ValueError, match="min_bytes must be >= 0"), memory.offload(min_bytes=-1):
        pass
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"), memory.offload("host"):
            pass
    for where in (tmp_path / "a-file", tmp_path / "missing"):
        where.with_name("a-file").write_text("")
        with (
            pytest.raises(NotADirectoryError, match="is not a directory: create it"),
            memory.offload("disk", directory=str(where)),
        ):
            pass
    assert (tmp_path / "a-file").read_text() == ""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root can write anyway
        with (
            pytest.raises(PermissionError, match="not writable"),
            memory.offload("disk", directory=str(locked)),
        ):
            pass


def test_offload_reduces_resident_memory_during_backward() -> None:
    """Child processes on glibc's default allocator, which returns freed blocks to the OS."""
    figures = {}
    for workload in ("saved-rss", "saved-rss-offload"):
        out = subprocess.run(
            [sys.executable, "-m", "spore._workloads", workload],
            capture_output=True,
            text=True,
            timeout=300,
            env=system_env(),
            check=False,
        )
        assert out.returncode == 0, out.stderr
        figures[workload] = json.loads(out.stdout.splitlines()[-1])
    plain, spilled = figures["saved-rss"], figures["saved-rss-offload"]
    assert spilled["offloaded_mib"] > 100
    saved = plain["rss_at_backward_mib"] - spilled["rss_at_backward_mib"]
    assert saved >= 0.8 * spilled["offloaded_mib"], figures
    assert plain["grad_checksum"] == spilled["grad_checksum"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload(target='host') needs CUDA")
def test_host_offload_frees_each_restored_activation_in_backward() -> None:
    """Each restored activation was kept on the GPU (and its pinned copy on the host) until
    backward ended, so backward's peak was no lower than without offload."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2048, 2048, device="cuda") for _ in range(8)]
    x = torch.randn(4096, 2048, device="cuda", requires_grad=True)

    def step(offloaded: bool) -> tuple[int, torch.Tensor]:
        x.grad = None
        with memory.offload("host") if offloaded else nullcontext():
            h = x
            for layer in layers:
                h = layer(h).relu()
            loss = h.square().mean()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # the peak from here: backward's, saved ones in
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), x.grad.clone()

    plain_peak, plain_grad = step(False)
    offloaded_peak, offloaded_grad = step(True)
    torch.testing.assert_close(offloaded_grad, plain_grad)
    activation = 4096 * 2048 * 4
    assert offloaded_peak < plain_peak - 2 * activation, (plain_peak, offloaded_peak)


# peak ------------------------------------------------------------------------------------------
MIB = 1 << 20


def test_peak_counts_live_storages_once() -> None:
    before = torch.zeros(MIB // 4)  # created outside: in-place results on it do not count
    with memory.peak() as meter:
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.ones(2 * MIB, dtype=torch.uint8)
        view = b[: MIB // 2].view(torch.int16)  # shares b's storage
        view.add_(1)
        before.add_(1)
        torch.mul(before, 2, out=before)
        del a
        c = torch.empty(MIB // 2, dtype=torch.uint8)
    assert meter.peak_bytes == 3 * MIB  # a + b, before a was freed
    assert meter.live_bytes == 2 * MIB + MIB // 2  # b + c
    del b, view, c
    assert meter.live_bytes == 0


def test_peak_counts_storages_resized_in_place() -> None:
    """Growing a tensor from before the block counts the growth; one made inside, empty at
    first and then resized, counts whole."""
    before = torch.zeros(10)
    with memory.peak() as meter:
        before.resize_(1000)
        made = torch.empty(0)
        made.resize_(500)
    assert (meter.peak_bytes, meter.live_bytes) == (4 * 990 + 4 * 500, 4 * 990 + 4 * 500)
    with memory.peak() as meter:
        before.resize_(10)  # shrinking frees nothing (the storage keeps its size)
        torch.zeros(100).resize_(200)
    assert (meter.peak_bytes, meter.live_bytes) == (800, 0)
    del made


def test_peak_follows_what_autograd_saves_until_backward() -> None:
    n = 1 << 16
    x = torch.randn(n, requires_grad=True)
    with memory.peak() as meter:
        y = x.exp()  # exp saves its result y
        z = y.sin()  # sin saves y too: no new storage
        loss = z.sum()
        forward_live = meter.live_bytes
        loss.backward()
        del y, z, loss
    assert forward_live == 2 * n * 4 + 4  # y, z and the loss
    assert meter.live_bytes == n * 4  # x.grad remains
    # backward: sin's makes cos(y) and its product with the upstream gradient while y and z
    # live (exp's then makes x.grad once cos(y) is freed); plus the loss and its 1-element seed
    assert meter.peak_bytes == 4 * n * 4 + 2 * 4
    x.grad = None
    assert meter.live_bytes == 0


RSS_CHILD = r"""
import json, torch
from spore import memory

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024

torch.set_num_threads(1)
x = torch.randn(2048, 4096, requires_grad=True)

def step():
    h = torch.tanh(x * 2)
    (h.exp() * x).square().sum().backward()
    x.grad = None

step()  # warm-up: first-call allocations stay out of the measurement
base = kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak resident size (VmHWM) to the current one
step()
rss = kib("VmHWM") - base
with memory.peak() as meter:
    step()
print(json.dumps({"rss": rss, "meter": meter.peak_bytes}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_agrees_with_the_peak_resident_size_of_a_child() -> None:
    from spore.childproc import run_json

    env = {**system_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave memory
    figures = run_json([sys.executable, "-c", RSS_CHILD], timeout=120, env=env)
    assert figures["meter"] > 150 * MIB
    assert figures["rss"] == pytest.approx(figures["meter"], rel=0.05)


def test_peak_counts_only_its_device() -> None:
    with memory.peak("cpu") as meter:
        kept = torch.empty(MIB, device="meta")
    assert meter.peak_bytes == 0
    assert kept.untyped_storage().nbytes() == 4 * MIB
    with memory.peak("meta") as meter:
        kept = torch.empty(MIB, device="meta")
        torch.empty(MIB)
    assert meter.peak_bytes == meter.live_bytes == 4 * MIB
