"""The resumable training loop: pre-training and MCD fine-tuning, around one step read top to
bottom.

:func:`train` runs one stage in four phases::

    restore    the checkpoint, when resuming
    for each epoch, each step:
        step       a pre-training step, or one MCD iteration (mcd_helpers.strategies.mcd_step)
        save       every cfg.checkpoint_every steps, and when a stop signal arrived
    at each epoch's end:
        validate   the discrepancy-score AUROC on the validation split (fine-tuning); best weights
        save

* **Steps.** Pre-training: CE(F1) + CE(F2) on a labeled batch. Fine-tuning: the official
  iteration (Step A, then Step B) or Step B alone (``cfg.schedule``), with the batches fed as the
  strategy's row of :data:`mcd_helpers.strategies.STRATEGIES` says. One SGD optimizer through all
  epochs.
* **Data order** is a pure function of the seed (:class:`Batches`), so a resumed run finds its
  batch by arithmetic; under torchrun each rank takes ``batch[rank::world]``.
* **Checkpoints**: one file written atomically (model, optimizer, scheduler, torch RNG, position,
  history, best weights); ``resume=True`` continues exactly. SIGTERM or SIGINT (Ctrl-C) finishes
  the step in progress, saves and raises :class:`~mcd_helpers.errors.TrainingInterrupted`; a second
  Ctrl-C stops at once.
* **No host sync per step** in one process: losses stay on the device and are read back and checked
  for NaN/inf at each save, before anything is written. Under DDP each step has one scalar
  ``all_reduce`` (the agreed stop flag; 0.4 ms on gloo, two CPU ranks).
* **DDP**: the loop trains the model it is given (wrapped by
  :func:`mcd_helpers.experiments.ddp.wrap`); BatchNorm statistics are averaged before validation,
  validation scores gathered, and rank 0 alone writes. In one process these calls do nothing.
"""

import contextlib
import signal
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..data import crop_flip, normalised_black
from ..errors import ConfigError, TrainingInterrupted
from ..losses import discrepancy_score, supervised_loss
from ..metrics import ood_metrics
from ..models import predict_logits
from ..strategies import get_strategy, mcd_step, train_mode
from . import ddp
from .files import load_state, save_state

# the streams of a run's random numbers: data orders, and pre-training's augmentation
PRETRAIN, LABELED, UNLABELED, AUGMENTATION = 0, 1, 2, 3


class Batches:
    """Batches of shuffled passes over ``n`` samples, a pure function of (seed, stream, pass).

    Pass ``p`` is ``torch.randperm(n)`` from a generator seeded with NumPy's ``SeedSequence([seed,
    stream, p])`` (nearby seeds, streams and passes stay independent); batch ``i`` is
    ``perm[i*B:(i+1)*B]``, a last incomplete batch dropped. So a resumed run finds its batch by
    arithmetic. Rank ``r`` of ``W`` takes ``[r::W]`` of it: the ranks' shares are disjoint and
    together the single-process batch.

    Raises:
        ValueError: ``batch_size`` not in ``[1, n]`` or not a multiple of ``world_size``.
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, stream: int, device="cpu", rank=0, world_size=1
    ):
        if not 1 <= batch_size <= n:
            raise ValueError(
                f"batch_size must be between 1 and the data set's size {n}, got {batch_size}."
            )
        if batch_size % world_size:
            raise ValueError(
                f"the global batch size {batch_size} must be a multiple of "
                f"--nproc_per_node={world_size}."
            )
        self.n = n
        self.batch_size = batch_size
        self.per_pass = n // batch_size
        self.seed = seed
        self.stream = stream
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self._pass = None
        self._perm = None

    def permutation(self, p: int) -> torch.Tensor:
        """The order of pass ``p``: a permutation of ``range(n)``, ``(n,)``."""
        if p != self._pass:
            sequence = np.random.SeedSequence([self.seed, self.stream, p])
            state = sequence.generate_state(1, dtype=np.uint64)[0]
            g = torch.Generator().manual_seed(int(state >> 1))
            self._perm = torch.randperm(self.n, generator=g).to(self.device)
            self._pass = p
        return self._perm

    def batch(self, p: int, i: int) -> torch.Tensor:
        """This rank's indices of batch ``i`` of pass ``p``, ``(B / W,)``."""
        if not 0 <= i < self.per_pass:
            raise IndexError(f"a pass has {self.per_pass} batches, asked for batch {i}.")
        rows = self.permutation(p)[i * self.batch_size : (i + 1) * self.batch_size]
        return rows[self.rank :: self.world_size]

    def batch_at(self, k: int) -> torch.Tensor:
        """Batch ``k`` of the endless stream of passes."""
        return self.batch(*divmod(k, self.per_pass))


@dataclass
class History:
    """Per-step losses (nats) and per-epoch validation AUROC (fraction) of a training stage."""

    # CE(F1) + CE(F2) on the labeled batch (Step B's when fine-tuning)
    ce: list[float] = field(default_factory=list)
    dis: list[float] = field(default_factory=list)  # discrepancy loss on the unlabeled batch
    gap: list[float] = field(default_factory=list)  # mean H(p1) - H(p2) on the unlabeled batch
    step_a: list[float] = field(default_factory=list)  # Step A's loss (official schedule)
    val_auroc: list[float] = field(default_factory=list)
    best_epoch: int = -1  # the epoch whose weights the model holds (stages.selected_epoch)


@contextlib.contextmanager
def _stop_signals(enabled: bool):
    """A dict whose ``"signal"`` becomes the number of a SIGTERM or SIGINT that arrives (main
    thread only)."""
    flag = {"signal": 0}

    def handler(signum, frame):
        flag["signal"] = signum
        if signum == signal.SIGINT:  # the next Ctrl-C stops at once
            signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {}
    if enabled and threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _take(t: torch.Tensor, idx: torch.Tensor, cfg, augment: Callable | None = None) -> torch.Tensor:
    """Rows ``idx`` of ``t``, ``augment``-ed when given, on ``cfg.device`` (NHWC when
    ``cfg.channels_last``)."""
    batch = t[idx] if augment is None else augment(t[idx])
    batch = batch.to(cfg.device, non_blocking=True)
    if cfg.channels_last and batch.dim() == 4:
        return batch.contiguous(memory_format=torch.channels_last)
    return batch


class _Stage:
    """One stage of training (pre-training, or one fine-tuning): the model, its optimizer and
    scheduler, the data order, the position, the history; the phases of :func:`train` as methods."""

    def __init__(self, model: nn.Module, split, cfg, strategy: str | None, checkpoint, key: str):
        self.model, self.split, self.cfg, self.strategy = model, split, cfg, strategy
        self.fine = strategy is not None
        self.net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.name = f"fine-tuning ({get_strategy(strategy).name})" if self.fine else "pre-training"
        prefix = "finetune_" if self.fine else "pretrain_"
        hyper = {k: getattr(cfg, prefix + k) for k in ("lr", "momentum", "weight_decay")}
        self.opt = torch.optim.SGD(self.net.parameters(), **hyper)
        milestones = [] if self.fine else list(cfg.pretrain_milestones)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(self.opt, milestones, gamma=0.1)
        self.data = [split.x_sup, split.y_sup, split.x_unsup]
        if cfg.data_on_device:  # the whole training data moved once
            self.data = [t.to(cfg.device) for t in self.data]
        rank, world = ddp.world()
        size, stream = (
            (cfg.batch_size_sup, LABELED) if self.fine else (cfg.pretrain_batch_size, PRETRAIN)
        )
        self.sup = Batches(
            len(split.x_sup), size, cfg.seed, stream, self.data[0].device, rank, world
        )
        self.unsup = None  # the unlabeled stream, when fine-tuning
        if self.fine:
            n, size = len(split.x_unsup), cfg.batch_size_unsup
            self.unsup = Batches(n, size, cfg.seed, UNLABELED, self.data[2].device, rank, world)
        self.epochs = cfg.finetune_epochs if self.fine else cfg.pretrain_epochs
        per_pass = self.sup.per_pass
        self.steps = min(cfg.steps_per_epoch or per_pass, per_pass) if self.fine else per_pass
        bf16, device_type = cfg.resolved_amp() == "bf16", torch.device(cfg.device).type
        self.autocast = lambda: torch.autocast(device_type, torch.bfloat16, enabled=bf16)
        position = {"epoch": 0, "step": 0, "best": None, "best_auroc": float("-inf")}
        self.state = {"stage": self.name, "key": key, **position}
        self.hist = History()
        self.pending = []  # (epoch, step, losses on the device) not yet read back

    # ---- restore ----
    def restore(self) -> None:
        """Model, optimizer, scheduler, RNG, position, history and best weights from the
        checkpoint; ConfigError (field ``resume``) when it was written with other settings."""
        saved = load_state(self.checkpoint)
        if (saved.get("stage"), saved.get("key")) != (self.name, self.state["key"]):
            raise ConfigError(
                "resume",
                f"the checkpoint {self.checkpoint} belongs to {saved.get('stage')!r} with settings "
                f"{saved.get('key')}, not {self.name!r} with {self.state['key']}: the settings "
                "changed. Resume with the interrupted run's settings, or pass --fresh to "
                "start over.",
            )
        for part, name in ((self.net, "model"), (self.opt, "optimizer"), (self.sched, "scheduler")):
            part.load_state_dict(saved[name])
        torch.set_rng_state(saved["rng"])
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        self.state.update({k: saved[k] for k in ("epoch", "step", "best", "best_auroc")})
        self.hist = History(**saved["history"])

    # ---- step ----
    def train_mode(self) -> None:
        """Train mode, BatchNorm as the strategy fine-tunes it (eval mode for eval-bn)."""
        if self.fine:
            train_mode(self.model, self.strategy)
        else:
            self.model.train()

    def step(self, epoch: int, step: int) -> None:
        """One training step on batch ``step`` of pass ``epoch``; its losses kept on the device."""
        cfg = self.cfg
        x_sup, y_sup, x_unsup = self.data
        idx = self.sup.batch(epoch, step)
        xs, ys = _take(x_sup, idx, cfg, self.augment(epoch, step)), y_sup[idx].to(cfg.device)
        if self.fine:  # ---- one MCD iteration: Step A, then Step B ----
            xu = _take(x_unsup, self.unsup.batch_at(epoch * self.steps + step), cfg)
            losses = mcd_step(
                self.model,
                self.opt,
                xs,
                ys,
                xu,
                self.strategy,
                cfg.margin,
                cfg.schedule,
                self.autocast,
            )
        else:  # ---- a pre-training step: CE(F1) + CE(F2) ----
            with self.autocast():
                loss = supervised_loss(*self.model(xs), ys)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            losses = {"ce": loss.detach()}
        self.names = tuple(losses)  # ce, dis, gap, step_a (official schedule); ce (pre-training)
        self.pending.append((epoch, step, torch.stack(list(losses.values()))))

    def augment(self, epoch: int, step: int) -> Callable | None:
        """Pre-training's crop and flip (``cfg.pretrain_crop_flip``; never in fine-tuning, as the
        official code), its random numbers a pure function of (seed, epoch, step) like the batch
        order, so a resumed run draws the same, and drawn for the global batch, so that under
        torchrun every image gets what it gets in one process."""
        if self.fine or not self.cfg.pretrain_crop_flip:
            return None
        sequence = np.random.SeedSequence([self.cfg.seed, AUGMENTATION, epoch, step])
        g = torch.Generator().manual_seed(int(sequence.generate_state(1)[0]))
        fill, share = normalised_black(self.cfg.id_dataset), ddp.world()
        return lambda x: crop_flip(x, g, pad=4, fill=fill.to(x.device), share=share)

    # ---- save ----
    def read_back(self) -> None:
        """One host sync: the pending per-step losses, checked for NaN and inf, into the history.

        Raises:
            FloatingPointError: naming the step and the loss parts, the last good checkpoint kept.
        """
        if not self.pending:
            return
        rows = torch.stack([r for _, _, r in self.pending]).float().cpu()  # (steps, parts)
        if (bad := (~torch.isfinite(rows)).any(dim=1)).any():
            i = int(bad.nonzero()[0])
            epoch, step, _ = self.pending[i]
            parts = ", ".join(f"{n}={v:.4g}" for n, v in zip(self.names, rows[i].tolist()))
            kept = ""
            if self.checkpoint is not None and self.checkpoint.exists():
                kept = f" The last good checkpoint is kept in {self.checkpoint}."
            raise FloatingPointError(
                f"non-finite loss in {self.name}, epoch {epoch + 1} step {step + 1}: "
                f"{parts}.{kept} Lower the learning rate or check the inputs for NaN."
            )
        for name, column in zip(self.names, rows.T.tolist()):
            getattr(self.hist, name).extend(column)
        self.pending.clear()

    def save(self, epoch: int, step: int) -> None:
        """The losses read back, then the checkpoint of position ``(epoch, step)`` (rank 0)."""
        self.read_back()
        # the ranks' mean statistics, so that a resumed run starts every rank where this one's mean
        # stands: the moving average is linear, so the final averaged statistics change by rounding
        ddp.average_buffers(self.net)
        self.state.update(epoch=epoch, step=step, history=asdict(self.hist))
        if self.checkpoint is None or not ddp.is_main():
            return
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        parts = {"model": self.net.state_dict(), "optimizer": self.opt.state_dict()}
        parts.update(
            scheduler=self.sched.state_dict(), rng=torch.get_rng_state(), cuda_rng=cuda_rng
        )
        save_state(self.checkpoint, {**self.state, **parts})

    def save_due(self, epoch: int, step: int) -> bool:
        """Whether ``cfg.checkpoint_every`` asks for a checkpoint after ``step`` of ``epoch``."""
        every = self.cfg.checkpoint_every
        return bool(every) and (epoch * self.steps + step + 1) % every == 0

    # ---- validate ----
    def validate(self, epoch: int, on_epoch: Callable | None) -> None:
        """The epoch's discrepancy-score AUROC on the whole validation split (every rank); the
        weights kept when it is the best so far (the first of ties)."""
        cfg, split = self.cfg, self.split

        def logits(x):
            return predict_logits(self.net, x, cfg.eval_batch_size, cfg.device)

        scores = [
            discrepancy_score(*ddp.gather(logits, v)) for v in (split.val_id_x, split.val_ood_x)
        ]
        self.hist.val_auroc.append(ood_metrics(*scores)["auroc"])
        if self.hist.val_auroc[-1] > self.state["best_auroc"]:
            best = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
            self.state.update(best_auroc=self.hist.val_auroc[-1], best=best)
        if on_epoch is not None:
            on_epoch(epoch, self.hist)

    def end_epoch(self, epoch: int, on_epoch: Callable | None) -> None:
        """Losses checked, the learning rate decayed, the ranks' mean statistics, the validation
        (fine-tuning), then the checkpoint of the next epoch's start."""
        self.read_back()
        self.sched.step()
        ddp.average_buffers(self.net)
        if self.fine:
            self.validate(epoch, on_epoch)
        self.save(epoch + 1, 0)

    def interrupted(self, signum: int, where: str) -> TrainingInterrupted:
        name = signal.Signals(signum).name
        return TrainingInterrupted(f"{name} {where}; saved in {self.checkpoint}.", signum)


def _prepare(model: nn.Module, cfg, fine: bool) -> nn.Module:
    """The model on ``cfg.device`` (NHWC when asked), compiled when asked, with ``cfg.bn_momentum``
    on every BatchNorm when fine-tuning; returns the plain module inside a DDP wrapper."""
    net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    layout = torch.channels_last if cfg.channels_last else torch.preserve_format
    net.to(cfg.device, memory_format=layout).train()
    # nn.Module.compile keeps the state_dict keys; dynamic=False: one graph per batch shape
    if cfg.compile and getattr(net, "_compiled_call_impl", None) is None:
        net.compile(dynamic=False)
    # the momentum moves the running statistics only: train mode normalises with the batch's
    if fine:
        for bn in (m for m in net.modules() if hasattr(m, "running_mean")):
            bn.momentum = cfg.bn_momentum
    return net


def train(
    model: nn.Module,
    split,
    cfg,
    strategy: str | None = None,
    checkpoint: Path | None = None,
    resume: bool = False,
    key: str = "",
    on_epoch: Callable | None = None,
    progress: bool = True,
) -> dict:
    """Pre-train (``strategy=None``) or fine-tune ``model`` on ``split`` with ``cfg``, in place.

    ``model``: a :class:`~mcd_helpers.models.TwoHeadNet` or its DDP wrapper; ``strategy``: a name of
    :data:`~mcd_helpers.strategies.STRATEGIES`; ``checkpoint``: the stage's file (None: none),
    continued when ``resume``; ``key``: the settings' hash stored with it (resuming with another is
    refused); ``on_epoch(epoch, history)``: called after each fine-tuning epoch (a live plot).

    Returns:
        ``{"history": History, "best": the state dict of the epoch with the best validation AUROC
        (the first of ties), "last": the last epoch's}``; the model holds the last epoch's weights.

    Raises:
        FloatingPointError: a loss became NaN or inf (the step and loss parts named; the last good
            checkpoint kept).
        TrainingInterrupted: after SIGTERM or SIGINT, once saved.
        ConfigError: (field ``resume``) the checkpoint was written with other settings.
    """
    net = _prepare(model, cfg, strategy is not None)
    stage = _Stage(model, split, cfg, strategy, checkpoint, key)
    if resume and stage.checkpoint is not None and stage.checkpoint.exists():
        stage.restore()
    with _stop_signals(checkpoint is not None) as flag:
        for epoch in range(stage.state["epoch"], stage.epochs):
            stage.train_mode()
            desc = f"{stage.name} {epoch + 1}/{stage.epochs}"
            steps = range(stage.state["step"], stage.steps)
            bar = dict(
                desc=desc, disable=not progress, leave=False, initial=steps.start, total=stage.steps
            )
            for step in tqdm(steps, **bar):
                stage.step(epoch, step)
                signum = ddp.reduce_max(flag["signal"], cfg.device)  # one rank stops, all stop
                if signum or stage.save_due(epoch, step):
                    stage.save(epoch, step + 1)
                if signum:
                    raise stage.interrupted(signum, f"in {desc} step {step + 1}/{stage.steps}")
            stage.end_epoch(epoch, on_epoch)
            if signum := ddp.reduce_max(flag["signal"], cfg.device):
                raise stage.interrupted(signum, f"at the end of {desc}")
            stage.state["step"] = 0
    # compiled for this stage only: a copy of net must not run net's compiled forward
    if cfg.compile:
        net._compiled_call_impl = None
    last = {k: v.detach().clone() for k, v in net.state_dict().items()}
    best = stage.state["best"] if stage.state["best"] is not None else last
    return {"history": stage.hist, "best": best, "last": last}
