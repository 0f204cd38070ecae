"""The training worker: one process per rank, started by :mod:`hyperparallel.launch`.

Each rank starts the process group through ``spore.distributed.init_process_group`` (mccl's
background init when installed, overlapping data and model building), shards the model with
FSDP2, trains with gradient accumulation and clipping, and checkpoints collectively. Rank 0
shows progress and writes the metrics, plot, resolved config and summary.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim.lr_scheduler import LambdaLR

from hyperparallel import checkpoint, data, parallel, registries, report
from hyperparallel import config as config_mod
from hyperparallel import model as model_mod
from hyperparallel.config import Config, DataSection, ParallelSection
from hyperparallel.corpus import default_corpus, default_corpus_info
from hyperparallel.launch import end_with_launcher


@dataclass
class Outcome:
    """What a run did (rank 0's view)."""

    steps_done: int
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    checkpoint: Path | None = None
    export: Path | None = None


def end_step(step: int, steps: int, stop_at: int | None) -> int:
    """The step this invocation trains to from ``step``: ``stop_at`` when it lies ahead (and
    within ``steps``), else ``steps`` (a resume at the ``stop_at`` that ended the last one
    continues)."""
    return min(steps, stop_at) if stop_at is not None and stop_at > step else steps


def run_log(resumed: Path | None, output: Path) -> Path:
    """The metrics log of the run a resume continues: that of the output whose ``checkpoints``
    folder holds ``resumed`` (``output`` itself, or the run resumed elsewhere) where there is
    one, readable or not, else ``output``'s (a checkpoint kept outside an output, or
    checkpoints moved away from their log, or none)."""
    if resumed is not None and resumed.absolute().parent.name == checkpoint.directory("").name:
        theirs = resumed.absolute().parent.parent / "metrics.jsonl"
        if theirs.exists():
            return theirs
    return output / "metrics.jsonl"


def unreadable_log(log: Path, why: str, output: Path) -> str:
    """The error for a resume whose :func:`run_log` cannot be read (``why``: the reason, e.g.
    an ``OSError``'s ``strerror``); ``output``: this run's."""
    own = output / "metrics.jsonl"
    if log.resolve() == own.resolve():  # moved away, none is continued
        instead = "to log only the steps after the checkpoint"
    else:  # moved away, run_log falls back to this run's own
        instead = (
            f"to continue {own} instead where there is one (its steps up to the checkpoint's), "
            f"else log only the steps after the checkpoint"
        )
    return (
        f"{log} cannot be read ({why}): a resume starts this run's metrics.jsonl "
        f"from it, up to the checkpoint's step; make it a readable file, or move it away "
        f"{instead}"
    )


def damaged_log(exc: ValueError) -> str:
    """The error for a resume whose :func:`run_log` holds a line that is not a metrics record
    (``exc``: :func:`hyperparallel.report.read_metrics`'s, naming it)."""
    return (
        f"{exc}: fix or delete that line (metrics.jsonl is the run's log; the checkpoint does "
        f"not need it)"
    )


def device_type(parallel_cfg: ParallelSection) -> str:
    if parallel_cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return parallel_cfg.device


def backend_for(parallel_cfg: ParallelSection, device: str) -> str:
    if parallel_cfg.backend != "auto":
        return parallel_cfg.backend
    return "nccl" if device == "cuda" else "gloo"


def documents(data_cfg: DataSection) -> tuple[list[str], str]:
    """The training documents and a one-line description of where they came from."""
    if data_cfg.path is None:
        return default_corpus(), default_corpus_info()
    docs = data.load_documents(data_cfg.path, data_cfg.text_key)
    return docs, f"{len(docs)} documents from {data_cfg.path}"


def _set_threads(device: str, threads: int | None) -> None:
    """parallel.threads, else this host's usable cores divided between its local ranks."""
    if device != "cpu":
        return
    from spore.runtime import cpu_plan

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The launcher already applied the allocator; "system" skips looking it up again per rank.
    plan = cpu_plan(allocator="system", ranks=local_world, rank=local_rank, threads=threads)
    torch.set_num_threads(plan.threads)


class InputError(Exception):
    """The user's data or model cannot be used; reported as one line, without a traceback."""


class Diverged(InputError):
    """The loss or the gradient norm is not finite: the run stops before saving that state."""


def _check_finite(step: int, loss: float, grad_norm: float, output: Path, clip: float) -> None:
    """:class:`Diverged` when ``loss`` or ``grad_norm`` is inf or NaN (the same on every rank:
    both are reduced over the ranks), naming the last checkpoint saved before."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    saved = checkpoint.complete(output)
    last = f"{saved[-1].name} is the last checkpoint" if saved else "no checkpoint was saved"
    fix = f"optim.grad_clip is {clip}" if clip > 0 else "or set optim.grad_clip"
    raise Diverged(
        f"step {step}: the loss is {loss}, the gradient norm {grad_norm}: training diverged and "
        f"stopped without saving this state ({last}); lower optim.lr ({fix})"
    )


def _rate_at(scheduler: Any, step: int) -> None:
    """Set the optimizer's rate to this run's schedule at ``step``, for the closed-form
    (``LambdaLR``) schedules, the built-in ones: the checkpoint holds the rate of the schedule
    it was saved under, which a resume with another ``run.steps`` has changed."""
    if isinstance(scheduler, LambdaLR):
        scheduler.last_epoch = step - 1
        scheduler.step()  # sets each group's rate for last_epoch = step


_NOT_SETTINGS = frozenset({"params", "lr", "initial_lr"})
"""Parameter-group keys that are not the optimizer's settings (the rate is the schedule's)."""


def _hyperparameters(optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """The optimizer's settings per parameter group and the schedule's peak rates."""
    found = {"lr": list(getattr(scheduler, "base_lrs", []))}
    for k, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key not in _NOT_SETTINGS:
                found[f"{key} (group {k})"] = list(value) if isinstance(value, tuple) else value
    return found


def _check_same_hyperparameters(
    path: Path, asked: dict[str, Any], saved: dict[str, Any], rate_may_change: bool
) -> None:
    """A resume continues the checkpoint's optimizer state and schedule, settings included: one
    whose config asks for others (``--set optim.betas=...``) would train with the saved ones
    while its config.yaml said otherwise, so it is refused. The peak rate may change where the
    schedule is worked out from it at each step (``rate_may_change``: the built-in ones)."""
    differ = [
        f"{key}: {saved.get(key)!r} saved, {value!r} asked"
        for key, value in asked.items()
        if saved.get(key) != value and not (key == "lr" and rate_may_change)
    ]
    if differ:
        allowed = "optim.lr may change, " if rate_may_change else ""
        raise InputError(
            f"--resume {path.name}: the checkpoint's optimizer settings differ from this run's "
            f"optim section ({'; '.join(differ)}); a resume continues the saved ones ({allowed}"
            f"the others not): resume with the run's own optim settings (its config.yaml), or "
            f"start a new run from its export (model.pretrained) to change them"
        )


def _set_peak_rates(optimizer: Any, scheduler: LambdaLR, rates: list[float]) -> None:
    """Give the loaded schedule this run's peak rates (``optim.lr``), e.g. a lower one after
    the run diverged; :func:`_rate_at` then works out each step's rate from them."""
    scheduler.base_lrs = list(rates)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["initial_lr"] = rate


def worker(settings: dict[str, Any], resume: str | None, launcher: int | None = None) -> None:
    """One rank's whole run (the elastic launcher's entry point; also runs under torchrun).

    ``launcher``: the pid of the ``spore train`` process that started this rank (None under
    torchrun); the rank ends with it (:func:`hyperparallel.launch.end_with_launcher`).
    A failure exits with status 1. An :class:`InputError` is one line, anything else this
    rank's traceback: handed to the launcher through the elastic error file when started by
    one (it prints each distinct error once), else printed (a one-line error by rank 0 only).
    """
    if launcher is not None:
        end_with_launcher(launcher)
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        _run(settings, resume)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; the launcher reports it once
        raise SystemExit(128 + signal.SIGINT) from None
    except InputError as exc:
        line = f"error: {exc}"
        if not _hand_over(line, launcher) and int(os.environ.get("RANK", "0")) == 0:
            print(line, file=sys.stderr, flush=True)
        _exit_failed()
    except (Exception, CheckpointException):  # DCP's CheckpointException is a BaseException
        if _interrupted(wait=1.0):  # an error from a peer that stopped on Ctrl-C first
            raise SystemExit(128 + signal.SIGINT) from None
        if not _hand_over(traceback.format_exc(), launcher):
            traceback.print_exc()
        _exit_failed()


def _hand_over(message: str, launcher: int | None) -> bool:
    """Write ``message`` to the elastic error file for the launcher that started this rank to
    print (:func:`hyperparallel.launch._failure_lines`); ``False`` when ``spore train`` did not
    start this rank (under torchrun each rank prints its own) or the file cannot be written."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if launcher is None or not error_file:
        return False
    try:
        Path(error_file).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    except OSError:
        return False
    return True


def _exit_failed() -> NoReturn:
    """End this rank with status 1, at once: with a process-group init still running in the
    background (a peer never joined), the plugin that started it ends the process from an exit
    handler, which sees only a ``sys.exit()`` status (mccl's: not a ``raise SystemExit``)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


def _interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT handler: interrupt once, then ignore SIGINT (Ctrl-C reaches every rank and the
    launcher sends its own), so that a second one cannot break the rank's exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _interrupted(wait: float) -> bool:
    """True when this rank got SIGINT, now or within ``wait`` seconds (Ctrl-C reaches every
    rank, but a peer that stopped first can break a collective here before it arrives)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return True
    try:
        time.sleep(wait)
    except KeyboardInterrupt:
        return True
    return False


def compile_failed(backend: str) -> str:
    """The note on a rank's ``BackendCompilerFailed`` under ``model.compile=backend``: the
    check before the start loads the backend, only the first step compiles the model."""
    return (
        f"model.compile={backend}: the backend loaded (checked before the start) but failed to "
        f"compile a decoder layer at the first step; choose another backend (e.g. inductor) or "
        f"model.compile: null (eager)"
    )


def _run(settings: dict[str, Any], resume: str | None) -> None:
    import spore.distributed
    from spore.plugins import get_manager

    get_manager().load()  # before the config: the sections and schedules plugins register
    cfg = config_mod.build(settings, world=int(os.environ.get("WORLD_SIZE", "1")))
    device = device_type(cfg.parallel)
    _set_threads(device, cfg.parallel.threads)
    rank = int(os.environ.get("RANK", "0"))
    options: dict[str, Any] = {"timeout": datetime.timedelta(seconds=cfg.parallel.init_timeout)}
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        options["device_id"] = torch.device("cuda", local)
    handle = spore.distributed.init_process_group(backend_for(cfg.parallel, device), **options)
    # Built while the rendezvous completes (mccl starts the process group in the background).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        tokenizer = data.ByteTokenizer()
        docs, source = documents(cfg.data)
        blocks = data.PackedBlocks(docs, tokenizer, cfg.data.seq_len, world=world)
        sampler = data.ShardedSampler(
            len(blocks), cfg.data.batch_size, rank, world, cfg.run.seed, blocks.fingerprint
        )
        model = model_mod.build(cfg.model, tokenizer.vocab_size, cfg.run.seed)
    except (ValueError, OSError) as exc:  # the user's data or model
        raise InputError(exc) from None
    finally:  # also before reporting an error: a rank never exits mid-rendezvous
        handle.wait()
    try:
        try:
            outcome = train(cfg, model, blocks, sampler, device, resume, source)
        except Exception as exc:
            if cfg.model.compile is not None:  # dynamo is imported then, not before
                from torch._dynamo.exc import BackendCompilerFailed

                if isinstance(exc, BackendCompilerFailed):
                    exc.add_note(compile_failed(cfg.model.compile))
            raise
        if rank == 0:
            _summary(cfg, model, outcome, source, world)
    finally:
        dist.destroy_process_group()


def train(
    cfg: Config,
    model: torch.nn.Module,
    blocks: data.PackedBlocks,
    sampler: data.ShardedSampler,
    device: str,
    resume: str | None,
    source: str = "",
) -> Outcome:
    """The training loop on an initialised process group; returns rank 0's :class:`Outcome`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    output = Path(cfg.run.output)
    mesh = parallel.mesh(device, world, cfg.parallel.replicate)
    model.to(device)
    parallel.shard(model, mesh, cfg.parallel, cfg.model.compile)
    fsdp = parallel.uses_fsdp(world, cfg.parallel)
    optimizer = registries.optimizers.get(cfg.optim.name)(model, cfg.optim)
    scheduler = registries.schedules.get(cfg.schedule.name)(optimizer, cfg.schedule, cfg.run.steps)
    state = checkpoint.TrainState(model, optimizer)
    step, resumed = 0, None
    if resume is not None:
        target = output if resume == "latest" else resume
        path = checkpoint.find(target)
        asked = _hyperparameters(optimizer, scheduler)
        try:
            extra = checkpoint.load(path, state)
        except checkpoint.Unreadable as exc:
            raise InputError(str(exc)) from None
        step = extra["step"]
        scheduler.load_state_dict(extra["scheduler"])
        saved = _hyperparameters(optimizer, scheduler)
        closed_form = isinstance(scheduler, LambdaLR)
        _check_same_hyperparameters(path, asked, saved, rate_may_change=closed_form)
        if saved["lr"] != asked["lr"]:
            _set_peak_rates(optimizer, scheduler, asked["lr"])
            if rank == 0:
                print(
                    f"note: --resume {path.name}: optim.lr is {cfg.optim.lr:g} (the checkpoint's "
                    f"was {saved['lr'][0]:g}); the schedule goes on from step {step} at the "
                    f"new rate",
                    file=sys.stderr,
                )
        _rate_at(scheduler, step)
        try:
            sampler.load_state_dict(extra["sampler"])
        except ValueError as exc:  # other documents than the checkpoint's
            raise InputError(f"--resume {path.name}: {exc}") from None
        if sampler.seed != cfg.run.seed:  # the saved order goes on; config.yaml would say not
            raise InputError(
                f"--resume {path.name}: the checkpoint's data order was seeded with "
                f"run.seed={sampler.seed}, this run asks run.seed={cfg.run.seed}; a resume "
                f"continues the saved order: resume with run.seed={sampler.seed} (its "
                f"config.yaml), or start a new run from its export (model.pretrained) to change it"
            )
        if rank == 0 and (note := _batch_note(cfg, path, extra, world)):
            print(note, file=sys.stderr, flush=True)
        if rank == 0 and (skipped := checkpoint.skipped(target, path)):
            print(
                f"note: skipped {', '.join(p.name for p in skipped)} (meta.json missing or "
                f"unreadable: damaged); resuming from {path.name}",
                file=sys.stderr,
                flush=True,
            )
        resumed = path
        if rank == 0 and (later := checkpoint.newer_than(output, path)):
            print(
                f"resuming from {path.name}, older than {', '.join(p.name for p in later)}: "
                f"this run's saves count as newer from here on (a save at the same step "
                f"replaces the old one; the oldest beyond checkpoint.keep are removed)",
                file=sys.stderr,
                flush=True,
            )
    end = end_step(step, cfg.run.steps, cfg.run.stop_at)
    if rank == 0 and step >= cfg.run.steps:
        print(
            f"resuming at step {step}: run.steps={cfg.run.steps} is reached, nothing to train "
            f"(raise run.steps to train on)",
            file=sys.stderr,
            flush=True,
        )
    elif rank == 0 and cfg.run.stop_at is not None and step >= cfg.run.stop_at:
        print(
            f"resuming at step {step}, at or past run.stop_at={cfg.run.stop_at}: training on "
            f"to run.steps={cfg.run.steps} (set run.stop_at to stop earlier)",
            file=sys.stderr,
            flush=True,
        )
    accum = cfg.optim.grad_accum
    tokens = cfg.data.batch_size * cfg.data.seq_len * accum * world
    outcome = Outcome(steps_done=step, tokens_per_step=tokens, checkpoint=resumed)
    first_step = step
    metrics = display = None
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        if step < end:  # a resume with nothing to train leaves the run's files as they are
            report.write_atomic(output / "config.yaml", cfg.to_yaml())
        log = run_log(resumed, output)
        try:
            metrics = report.Metrics(output / "metrics.jsonl", step, log)
        except ValueError as exc:  # preflight's checks, where they ran, passed: changed since
            raise InputError(damaged_log(exc)) from None
        except OSError as exc:
            raise InputError(unreadable_log(log, exc.strerror or str(exc), output)) from None
        display = report.ProgressDisplay(cfg.run.name, cfg.run.steps, step, cfg.run.log_every)
    started = time.perf_counter()
    try:
        while step < end:
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                ids, labels = data.batch(blocks, sampler.next_indices())
                if fsdp:
                    model.set_requires_gradient_sync(micro == accum - 1)
                logits = model(input_ids=ids.to(device)).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten())
                (loss / accum).backward()
                loss_sum += loss.detach()
            grad_norm = clipped_grad_norm(model, cfg.optim.grad_clip)
            lr = scheduler.get_last_lr()[0]  # the rate this update uses
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if world > 1:
                dist.all_reduce(loss_sum)
            mean_loss = loss_sum.item() / (accum * world)
            step += 1
            dt = time.perf_counter() - t0
            outcome.losses.append(mean_loss)
            outcome.step_times.append(dt)
            if rank == 0:
                metrics.write(
                    {
                        "step": step,
                        "loss": mean_loss,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "step_time_s": dt,
                        "tokens_per_s": tokens / dt,
                        "elapsed_s": time.perf_counter() - started,
                    }
                )
                display.update(step, mean_loss, tokens / dt, dt)
            _check_finite(step, mean_loss, grad_norm, output, cfg.optim.grad_clip)
            every = cfg.checkpoint.every
            if (every and step % every == 0) or step == end:
                extra = {
                    "step": step,
                    "scheduler": scheduler.state_dict(),
                    "sampler": sampler.state_dict(),
                    "data": {"seq_len": cfg.data.seq_len},
                    "schedule": cfg.schedule.model_dump(),
                    "grad_accum": accum,
                }
                outcome.checkpoint = checkpoint.save(
                    output, step, state, extra, keep=cfg.checkpoint.keep, parent=outcome.checkpoint
                )
    finally:
        if rank == 0:
            display.close()
            metrics.close()
    outcome.steps_done = step
    reached = outcome.checkpoint  # at run.steps: the checkpoint saved at the end, or resumed
    if (
        step == cfg.run.steps
        and cfg.checkpoint.export
        and (step > first_step or _export_outdated(output, reached))
    ):
        outcome.export = checkpoint.export(model, output, reached)
    if rank == 0:
        history = report.read_metrics(output / "metrics.jsonl")
        if history:
            report.plot(history, output / "loss.png", f"{cfg.run.name}: training loss")
    return outcome


def _batch_note(cfg: Config, path: Path, extra: dict[str, Any], world: int) -> str | None:
    """A note where the resumed checkpoint (``extra``: its trainer.pt) was trained with another
    ``optim.grad_accum``: the global batch changes from here on (the ranks and
    ``data.batch_size`` are the saved ones, the data layout checked); None when it is the same
    or the checkpoint does not say (saved before trainer.pt recorded it)."""
    saved, accum = extra.get("grad_accum", cfg.optim.grad_accum), cfg.optim.grad_accum
    if saved == accum:
        return None
    per_step = cfg.data.batch_size * world
    tokens = per_step * cfg.data.seq_len
    return (
        f"note: --resume {path.name}: optim.grad_accum is {accum} (the checkpoint's was "
        f"{saved}): the global batch goes from {per_step * saved} to {per_step * accum} "
        f"sequences per step (data.batch_size={cfg.data.batch_size} x {world} rank(s) x "
        f"optim.grad_accum; {tokens * saved} -> {tokens * accum} tokens); optim.lr and the "
        f"schedule are not rescaled"
    )


def _export_outdated(output: Path, resumed: Path) -> bool:
    """Whether a resume of ``resumed`` that trains nothing exports it: ``final/`` is missing
    (an export stopped midway), or ``resumed`` is the output's own newest save and ``final/``
    does not hold its weights (a run stopped between its last save and its export, or an
    export that names no checkpoint). A ``final/`` stays beside a save newer than ``resumed``,
    or where ``resumed`` is another output's: the resume would replace it with weights that
    are not the run's newest."""
    if not (output / "final").is_dir():
        return True
    done = checkpoint.complete(output)
    newest = bool(done) and done[-1].resolve() == resumed.resolve()
    return newest and not checkpoint.holds_export_of(output, resumed)


def clipped_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """The global gradient norm, before clipping to ``max_norm`` (0: no clipping). Worked out
    either way: a non-finite gradient must stop the run before its update is saved."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _summary(
    cfg: Config, model: torch.nn.Module, outcome: Outcome, source: str, world: int
) -> None:
    output = Path(cfg.run.output)
    # a resume that trains nothing into a new output writes neither
    metrics, curve = output / "metrics.jsonl", output / "loss.png"
    losses, times = outcome.losses, outcome.step_times
    first = max(1, min(10, len(losses) // 2))  # two windows that overlap only for one step
    loss, throughput = "- (no step trained)", "-"
    if losses:
        head, tail = statistics.fmean(losses[:first]), statistics.fmean(losses[-first:])
        loss = f"{head:.4f} (first {first}) -> {tail:.4f} (last {first})"
        step_s = statistics.median(times)
        rate = outcome.tokens_per_step / step_s
        throughput = f"{rate:,.0f} tokens/s (median step {step_s:.3f} s)"
    if cfg.parallel.replicate > 1:
        layout = f"{world} ranks, HSDP {cfg.parallel.replicate} x {world // cfg.parallel.replicate}"
    elif parallel.uses_fsdp(world, cfg.parallel):
        layout = f"{world} rank(s), FSDP2"
    else:
        layout = "1 rank, unsharded (FSDP2 from 2 ranks or with mixed precision)"
    rows = [
        (
            "model",
            f"{cfg.model.pretrained or model_mod.type_name(cfg.model)}, "
            f"{model_mod.parameter_count(model) / 1e6:.2f} M parameters",
        ),
        ("data", source),
        ("parallel", layout),
        ("steps", f"{outcome.steps_done} / {cfg.run.steps} (this invocation: {len(losses)})"),
        ("loss", loss),
        ("throughput", throughput),
        ("metrics", str(metrics) if metrics.is_file() else "-"),
        ("loss curve", str(curve) if curve.is_file() else "-"),
        ("checkpoint", str(outcome.checkpoint or "-")),
        ("export", str(outcome.export or "-")),
    ]
    report.summary(rows)
