"""The training loop's parts shared by pre-training and fine-tuning (:mod:`mcd_helpers.training.loop`).

* The GPU fast path: :func:`prepare_model` (device, ``channels_last``, :func:`compile_model`),
  :func:`autocast` (bfloat16), :func:`place` / :func:`take` (data held on the device).
* Run control: :func:`stop_on_sigterm` (SIGTERM or SIGINT: finish the step, checkpoint, stop),
  :func:`read_back` (per-step losses kept on the device and read back once per checkpoint, then
  checked for NaN/inf), :func:`load_stage_state` (resume, refusing a checkpoint of other settings).
"""
from __future__ import annotations

import contextlib
import signal
import threading

import torch
from torch import nn

from ..errors import CheckpointMismatchError, NonFiniteLossError, TrainingInterrupted

__all__ = ["compile_model", "prepare_model", "autocast", "place", "take", "stop_on_sigterm", "stop_on_signal",
           "StopFlag", "read_back", "load_stage_state"]


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """``torch.compile`` the feature extractor G in place (the model itself if it has no ``G``).

    G, not the whole model: Step A calls ``model.features`` and the heads directly, so a compiled
    ``forward`` alone would leave Step A uncompiled. ``nn.Module.compile`` keeps the
    ``state_dict`` keys, so checkpoints load into uncompiled models. ``dynamic=False``: the
    batch shapes of a run are few and fixed (pre-training and labeled batches, unlabeled batches,
    their concatenation, evaluation batches), each compiled once and then reused; no recompiles
    per step and no dynamic-shape kernels. A model compiled already is left as it is (so calling
    :func:`~mcd_helpers.training.loop.finetune` once per epoch compiles once). Returns ``model``.
    """
    target = model.G if isinstance(getattr(model, "G", None), nn.Module) else model
    if getattr(target, "_compiled_call_impl", None) is None:  # set by nn.Module.compile: compile once
        target.compile(dynamic=False, backend=backend)
    return model


def prepare_model(model: nn.Module, cfg) -> nn.Module:
    """Move ``model`` to ``cfg.device``; apply ``cfg.channels_last`` and ``cfg.compile``. Returns it."""
    model.to(torch.device(cfg.device))
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    if cfg.compile:
        compile_model(model)
    return model


def autocast(cfg, device: torch.device):
    """``torch.autocast`` to bfloat16 on ``device`` when ``cfg.amp == "bf16"``, else a no-op context.

    bfloat16 keeps float32's exponent range, so gradients need no loss scaling (unlike float16).
    Wrap forwards and losses only; backward runs outside it.
    """
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16")


def place(t: torch.Tensor, cfg) -> torch.Tensor:
    """``t`` moved to ``cfg.device`` when ``cfg.data_on_device``, else ``t`` itself."""
    return t.to(cfg.device) if cfg.data_on_device else t


def take(t: torch.Tensor, idx: torch.Tensor, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    """Rows ``idx`` ``(B,)`` of ``t`` ``(N, ...)`` -> ``(B, ...)`` on ``device`` (NHWC if ``channels_last``)."""
    batch = t[idx].to(device, non_blocking=True)  # gathered where the data lives, then moved
    if channels_last and batch.dim() == 4:
        batch = batch.contiguous(memory_format=torch.channels_last)
    return batch


class StopFlag:
    """Set by :func:`stop_on_sigterm`'s handler: ``requested`` and the signal's ``name`` and number."""

    def __init__(self):
        self.requested, self.signum, self.name = False, None, ""

    def interrupted(self, message: str) -> TrainingInterrupted:
        """The exception to raise once the checkpoint is saved; ``message`` follows the signal's name."""
        return TrainingInterrupted(f"{self.name} {message}", self.signum)


@contextlib.contextmanager
def stop_on_sigterm(enabled: bool):
    """Yield a :class:`StopFlag` whose ``requested`` turns True on SIGTERM or SIGINT (Ctrl-C).

    The loop finishes the step in progress, saves a checkpoint and raises ``flag.interrupted(...)``.
    After the first SIGINT, a second one interrupts at once (``KeyboardInterrupt``), for a user who
    does not want to wait for the step. Main thread only; the handlers are restored afterwards.
    """
    flag = StopFlag()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        flag.requested, flag.signum, flag.name = True, signum, signal.Signals(signum).name
        if signum == signal.SIGINT:  # the next Ctrl-C stops at once
            signal.signal(signal.SIGINT, signal.default_int_handler)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


stop_on_signal = stop_on_sigterm  # the same: SIGTERM and SIGINT


def read_back(pending: list, names: tuple[str, ...], stage: str, checkpoint) -> list[list[float]]:
    """Copy the pending per-step loss records to the host (one sync), check them, return them as rows.

    Raises:
        NonFiniteLossError: naming the first step with a NaN or inf and its loss parts.
    """
    if not pending:
        return []
    rows = torch.stack([record for _, _, record in pending]).float().cpu()  # (steps, parts)
    bad = (~torch.isfinite(rows)).any(dim=1)
    if bad.any():
        first = int(bad.nonzero()[0])
        epoch, step, _ = pending[first]
        detail = ", ".join(f"{n}={v:.4g}" for n, v in zip(names, rows[first].tolist()))
        saved = checkpoint is not None and (checkpoint.last.exists() or checkpoint.prev.exists())
        kept = f" The last good checkpoint is kept in {checkpoint.folder}." if saved else ""
        raise NonFiniteLossError(f"non-finite loss in {stage}, epoch {epoch + 1} step {step + 1}: {detail}."
                                 f"{kept} Lower the learning rate or check the inputs for NaN.")
    pending.clear()
    return rows.tolist()


def load_stage_state(checkpoint, resume: bool, stage: str, key: str) -> dict | None:
    """The stage's last checkpoint when resuming, else ``None`` (and, not resuming, old ones deleted).

    Raises:
        CheckpointMismatchError: if the checkpoint belongs to another stage or settings (``key``,
            a config hash); a ``ValueError``.
        CorruptCheckpointError: if checkpoint files exist but none can be read.
    """
    if checkpoint is None:
        return None
    if not resume:  # a fresh start: checkpoints of an earlier run must not become "last.prev.pt"
        checkpoint.clear()
        return None
    state = checkpoint.load(required=("stage", "key", "model", "optimizer", "rng", "epoch", "step"))
    if state is not None and (state["stage"], state["key"]) != (stage, key):
        raise CheckpointMismatchError(f"the checkpoint in {checkpoint.folder} belongs to {state['stage']!r} with settings "
                         f"{state['key']}, not {stage!r} with {key}: the run's settings changed. Resume with "
                         "the same settings, or run without resume (or with another output folder).")
    return state
