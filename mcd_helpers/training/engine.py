"""The training engine's parts shared by pre-training and fine-tuning (:mod:`mcd_helpers.train`).

* :class:`ShuffledBatches`: the data order (a seeded DataLoader's) as a pure function of (seed,
  pass), so a resumed run skips consumed batches by arithmetic and the data set may live on the
  GPU. Under ``torchrun`` each rank takes its share of every batch of the same permutation
  (:class:`mcd_helpers.distributed.ShardedBatches`), so the global batches are the single-process ones.
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

__all__ = ["NonFiniteLossError", "TrainingInterrupted", "CheckpointMismatchError", "ShuffledBatches", "compile_model", "prepare_model",
           "autocast", "place", "take", "stop_on_sigterm", "stop_on_signal", "StopFlag", "read_back", "load_stage_state"]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the message names the step and the loss parts."""


class CheckpointMismatchError(ValueError):
    """Resuming found a checkpoint written by another stage or with other settings."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM or SIGINT (Ctrl-C) arrived; the stage was checkpointed after the step in progress.

    ``signal`` is the signal's number: the command line exits with ``128 + signal`` (143 for
    SIGTERM, 130 for SIGINT), as a shell reports a process killed by it.
    """

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signal = int(signum)


class ShuffledBatches:
    """Index batches of shuffled passes over ``n`` samples, a pure function of (seed, stream, pass).

    The order is that of ``DataLoader(dataset, batch_size=B, shuffle=True, drop_last=True,
    generator=torch.Generator().manual_seed(seed + stream))`` iterated again for every pass (the
    loaders of the first version of this package, so the quick preset's numbers are unchanged):
    pass ``p`` is the permutation that ``RandomSampler`` draws on the loader's ``p``-th iteration,
    and its batch ``i`` is ``perm[i * B:(i + 1) * B]`` (a last incomplete batch is dropped). Per
    iteration the loader draws an int64 (its iterator's base seed; once more for each further
    iterator made and dropped, ``iterators`` - 1 of them) and ``randperm(n)``; a pass run to its
    end (``drained=True``, a ``for`` loop over the loader) draws one more ``randperm(n)`` that it
    never uses, a pass cut short (``itertools.islice``) does not. Asking for pass ``p`` replays
    those draws, so a resumed run needs no saved sampler state; the current pass's permutation is
    cached. (``tests/test_train.py`` checks the order against a real DataLoader.)

    Args:
        n: samples in the data set; batch_size: ``B``; seed: the run's seed;
        stream: added to the seed, telling the run's streams apart (pre-training 0, labeled 1,
            unlabeled 2, as the first version's loaders did);
        device: where the index tensors are put (the data's device);
        drained: whether every pass runs to its end (see above);
        iterators: loader iterators made per pass (2 where ``tqdm.auto`` wrapped the loader: its
            asyncio wrapper calls ``iter`` once more).

    Raises:
        ValueError: if ``batch_size`` is not in ``[1, n]`` (no full batch could be formed).
    """

    def __init__(self, n: int, batch_size: int, seed: int, stream: int = 0, device="cpu", drained: bool = True,
                 iterators: int = 1):
        if not 1 <= batch_size <= n:
            raise ValueError(f"batch_size must be between 1 and the data set's size {n}, got {batch_size}; "
                             "lower the batch size or use more data.")
        self.n, self.batch_size, self.seed, self.stream, self.drained = n, batch_size, seed, stream, drained
        self.iterators = iterators
        self.device = torch.device(device)
        self.per_pass = n // batch_size  # full batches per pass
        self._gen, self._pass, self._perm = None, -1, None

    def permutation(self, p: int) -> torch.Tensor:
        """The order of pass ``p``: a permutation of ``range(n)``, shape ``(n,)``."""
        if p != self._pass or self._perm is None:
            if self._gen is None or p < self._pass:  # start over and replay
                self._gen, self._pass = torch.Generator().manual_seed(self.seed + self.stream), -1
            while self._pass < p:
                if self._pass >= 0 and self.drained:
                    torch.randperm(self.n, generator=self._gen)  # drawn at the end of a drained pass
                for _ in range(self.iterators):  # each iterator's base seed
                    torch.empty((), dtype=torch.int64).random_(generator=self._gen)
                perm = torch.randperm(self.n, generator=self._gen)
                self._pass += 1
            self._perm = perm.to(self.device)
        return self._perm

    def batch(self, p: int, i: int) -> torch.Tensor:
        """Indices of batch ``i`` of pass ``p``, shape ``(B,)``."""
        if not 0 <= i < self.per_pass:
            raise IndexError(f"a pass has {self.per_pass} batches, asked for batch {i}.")
        return self.permutation(p)[i * self.batch_size:(i + 1) * self.batch_size]

    def batch_at(self, k: int) -> torch.Tensor:
        """Indices of the ``k``-th batch of the endless stream (pass ``k // per_pass``)."""
        return self.batch(*divmod(k, self.per_pass))


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """``torch.compile`` the feature extractor G in place (the model itself if it has no ``G``).

    G, not the whole model: Step A calls ``model.features`` and the heads directly, so a compiled
    ``forward`` alone would leave Step A uncompiled. ``nn.Module.compile`` keeps the
    ``state_dict`` keys, so checkpoints load into uncompiled models. ``dynamic=False``: the
    batch shapes of a run are few and fixed (pre-training and labeled batches, unlabeled batches,
    their concatenation, evaluation batches), each compiled once and then reused; no recompiles
    per step and no dynamic-shape kernels. A model compiled already is left as it is (so calling
    :func:`~mcd_helpers.train.finetune` once per epoch compiles once). Returns ``model``.
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
