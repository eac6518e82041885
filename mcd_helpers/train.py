"""Pre-training and MCD fine-tuning: one plain PyTorch loop, read top to bottom.

* **Steps.** Pre-training: CE(F1) + CE(F2) on a labeled batch. Fine-tuning (official
  ``solver.py``): Step A then Step B (:mod:`mcd_helpers.forwards`) each iteration
  (``cfg.schedule == "official"``), or Step B alone (``"step_b"``). One SGD optimizer through all epochs.
* **Data order** is a pure function of the seed (:class:`Batches`), so a resumed run finds its batch
  by arithmetic; under torchrun each rank takes ``batch[rank::world]``.
* **Checkpoints**: every ``cfg.checkpoint_every`` steps and at each epoch end, one file written
  atomically (model, optimizer, scheduler, torch RNG, position, history, best weights);
  ``resume=True`` continues exactly. SIGTERM or SIGINT (Ctrl-C) finishes the step in progress,
  saves and raises :class:`~mcd_helpers.errors.TrainingInterrupted`; a second Ctrl-C stops at once.
* **No host sync per step** in one process: losses stay on the device and are read back and checked
  for NaN/inf at each checkpoint and epoch end, before anything is saved. Under DDP each step has one
  scalar ``all_reduce`` (the agreed stop flag; 0.4 ms on gloo, two CPU ranks).
* **DDP**: the loop trains the model it is given (wrapped by :func:`mcd_helpers.ddp.wrap`); the stop
  is agreed over the ranks at every step, BatchNorm statistics are averaged before validation,
  validation scores gathered, and rank 0 alone writes. In one process these calls do nothing.
"""

import contextlib
import random
import signal
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from . import ddp
from .errors import ConfigError, TrainingInterrupted
from .files import load_state, save_state
from .forwards import check_strategy, step_a_loss, step_b_loss
from .losses import discrepancy_score, supervised_loss
from .metrics import ood_metrics
from .norms import freeze_bn

PRETRAIN, LABELED, UNLABELED = 0, 1, 2  # the streams of a run's data order


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's generators (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Batches:
    """Batches of shuffled passes over ``n`` samples, a pure function of (seed, stream, pass).

    Pass ``p`` is ``torch.randperm(n)`` from a generator seeded with NumPy's ``SeedSequence([seed,
    stream, p])`` (nearby seeds, streams and passes stay independent); batch ``i`` is
    ``perm[i*B:(i+1)*B]``, a last incomplete batch dropped. Rank ``r`` of ``W`` takes ``[r::W]`` of
    it: the ranks' shares are disjoint and together the single-process batch.

    Raises:
        ValueError: ``batch_size`` not in ``[1, n]`` or not a multiple of ``world_size``.
    """

    def __init__(self, n: int, batch_size: int, seed: int, stream: int, device="cpu", rank: int = 0, world_size: int = 1):
        if not 1 <= batch_size <= n:
            raise ValueError(f"batch_size must be between 1 and the data set's size {n}, got {batch_size}.")
        if batch_size % world_size:
            raise ValueError(f"the global batch size {batch_size} must be a multiple of --nproc_per_node={world_size}.")
        self.n, self.batch_size, self.per_pass, self.seed, self.stream = n, batch_size, n // batch_size, seed, stream
        self.device, self.rank, self.world_size, self._pass, self._perm = device, rank, world_size, None, None

    def permutation(self, p: int) -> torch.Tensor:
        """The order of pass ``p``: a permutation of ``range(n)``, ``(n,)``."""
        if p != self._pass:
            state = np.random.SeedSequence([self.seed, self.stream, p]).generate_state(1, dtype=np.uint64)[0]
            g = torch.Generator().manual_seed(int(state >> 1))
            self._perm, self._pass = torch.randperm(self.n, generator=g).to(self.device), p
        return self._perm

    def batch(self, p: int, i: int) -> torch.Tensor:
        """This rank's indices of batch ``i`` of pass ``p``, ``(B / W,)``."""
        if not 0 <= i < self.per_pass:
            raise IndexError(f"a pass has {self.per_pass} batches, asked for batch {i}.")
        return self.permutation(p)[i * self.batch_size:(i + 1) * self.batch_size][self.rank::self.world_size]

    def batch_at(self, k: int) -> torch.Tensor:
        """Batch ``k`` of the endless stream of passes."""
        return self.batch(*divmod(k, self.per_pass))


@torch.inference_mode()
def predict_logits(model: nn.Module, x: torch.Tensor, batch_size: int = 1000, device="cpu") -> tuple:
    """Both heads' logits in eval mode (the mode is restored): ``(N, C, H, W)`` -> two ``(N, K)`` CPU tensors."""
    was_training = model.training
    model.eval()
    try:
        outs = [model(x[i:i + batch_size].to(device)) for i in range(0, len(x), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat([o[0] for o in outs]).cpu(), torch.cat([o[1] for o in outs]).cpu()


@dataclass
class History:
    """Per-step losses (nats) and per-epoch validation AUROC (fraction) of a training stage."""
    ce: list[float] = field(default_factory=list)  # CE(F1) + CE(F2) on the labeled batch (Step B's when fine-tuning)
    dis: list[float] = field(default_factory=list)  # discrepancy loss on the unlabeled batch
    gap: list[float] = field(default_factory=list)  # mean H(p1) - H(p2) on the unlabeled batch
    step_a: list[float] = field(default_factory=list)  # Step A's loss (official schedule)
    val_auroc: list[float] = field(default_factory=list)
    best_epoch: int = -1  # the epoch whose weights the model holds (pipeline.selected_epoch)


@contextlib.contextmanager
def _stop_signals(enabled: bool):
    """A dict whose ``"signal"`` becomes the number of a SIGTERM or SIGINT that arrives (main thread only)."""
    flag = {"signal": 0}

    def handler(signum, frame):
        flag["signal"] = signum
        if signum == signal.SIGINT:  # the next Ctrl-C stops at once
            signal.signal(signal.SIGINT, signal.default_int_handler)

    enabled = enabled and threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)} if enabled else {}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _take(t: torch.Tensor, idx: torch.Tensor, cfg) -> torch.Tensor:
    """Rows ``idx`` of ``t``, on ``cfg.device`` (NHWC when ``cfg.channels_last``)."""
    batch = t[idx].to(cfg.device, non_blocking=True)
    return batch.contiguous(memory_format=torch.channels_last) if cfg.channels_last and batch.dim() == 4 else batch


def train(model: nn.Module, split, cfg, strategy: str | None = None, checkpoint: Path | None = None,
          resume: bool = False, key: str = "", on_epoch: Callable | None = None, progress: bool = True) -> dict:
    """Pre-train (``strategy=None``) or fine-tune ``model`` on ``split`` with ``cfg``, in place.

    Pre-training: ``cfg.pretrain_epochs`` passes over ``split.x_sup`` with CE on both heads, SGD with
    step decay at ``cfg.pretrain_milestones``. Fine-tuning: ``cfg.finetune_epochs`` epochs of one pass
    over the labeled set (capped at ``cfg.steps_per_epoch`` when > 0), each iteration a labeled batch
    and the next batch of the unlabeled stream ``split.x_unsup``; after each epoch the discrepancy-score
    AUROC on ``split.val_id_x`` vs ``split.val_ood_x`` (recorded; it never changes the training).

    Args:
        model: a :class:`~mcd_helpers.models.TwoHeadNet`, or its DDP wrapper (every forward goes through it).
        strategy: one of :data:`~mcd_helpers.forwards.STRATEGIES` (fine-tuning) or None (pre-training).
        checkpoint: the stage's checkpoint file (none when None); resume: continue from it when it exists.
        key: the settings' hash stored with the checkpoint; resuming with another key is refused.
        on_epoch: ``on_epoch(epoch, history)`` after each fine-tuning epoch (a live plot).

    Returns:
        ``{"history": History, "best": state dict of the epoch with the best validation AUROC (first
        of ties), "last": the last epoch's}`` (fine-tuning; pre-training gives ``history`` only); the
        model holds the last epoch's weights.

    Raises:
        FloatingPointError: a loss became NaN or inf (the step and loss parts named; the last good
            checkpoint kept). TrainingInterrupted: after SIGTERM or SIGINT, once saved.
        ConfigError: (field ``resume``) the checkpoint was written with other settings.
    """
    fine = strategy is not None
    net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    net.to(cfg.device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format).train()
    if cfg.compile and getattr(net, "_compiled_call_impl", None) is None:  # nn.Module.compile keeps the state_dict keys
        net.compile(dynamic=False)  # one graph per batch shape, each compiled once
    if fine:  # BatchNorm's momentum moves its running statistics only: train mode normalises with the batch's own
        for bn in (m for m in net.modules() if hasattr(m, "running_mean")):
            bn.momentum = cfg.bn_momentum
    prefix = "finetune_" if fine else "pretrain_"
    opt = torch.optim.SGD(net.parameters(), **{k: getattr(cfg, prefix + k) for k in ("lr", "momentum", "weight_decay")})
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [] if fine else list(cfg.pretrain_milestones), gamma=0.1)
    x_sup, y_sup, x_unsup = (t.to(cfg.device) if cfg.data_on_device else t  # the whole training data moved once
                             for t in (split.x_sup, split.y_sup, split.x_unsup))
    rank, world = ddp.world()
    sup = Batches(len(x_sup), cfg.batch_size_sup if fine else cfg.pretrain_batch_size, cfg.seed,
                  LABELED if fine else PRETRAIN, x_sup.device, rank, world)
    unsup = Batches(len(x_unsup), cfg.batch_size_unsup, cfg.seed, UNLABELED, x_unsup.device, rank, world) if fine else None
    epochs = cfg.finetune_epochs if fine else cfg.pretrain_epochs
    steps = min(cfg.steps_per_epoch or sup.per_pass, sup.per_pass) if fine else sup.per_pass
    official = fine and cfg.schedule == "official"
    names = ("ce", "dis", "gap") + (("step_a",) if official else ()) if fine else ("ce",)
    stage = f"fine-tuning ({check_strategy(strategy)})" if fine else "pre-training"
    bf16 = cfg.resolved_amp() == "bf16"
    autocast = lambda: torch.autocast(torch.device(cfg.device).type, torch.bfloat16, enabled=bf16)  # noqa: E731
    state = {"stage": stage, "key": key, "epoch": 0, "step": 0, "history": asdict(History()),
             "best": None, "best_auroc": float("-inf")}

    # ---- resume: model, optimizer, scheduler, RNG, position, history, best weights so far ----
    if checkpoint is not None and resume and Path(checkpoint).exists():
        saved = load_state(checkpoint)
        if (saved.get("stage"), saved.get("key")) != (stage, key):
            raise ConfigError("resume", f"the checkpoint {checkpoint} belongs to {saved.get('stage')!r} with settings "
                                        f"{saved.get('key')}, not {stage!r} with {key}: the settings changed. Resume "
                                        "with the interrupted run's settings, or pass --fresh to start over.")
        for part, name in ((net, "model"), (opt, "optimizer"), (sched, "scheduler")):
            part.load_state_dict(saved[name])
        torch.set_rng_state(saved["rng"])
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        state.update({k: saved[k] for k in ("epoch", "step", "history", "best", "best_auroc")})
    hist, pending = History(**state["history"]), []

    def read_back() -> None:  # one host sync: the pending per-step losses, checked, into the history
        if not pending:
            return
        rows = torch.stack([r for _, _, r in pending]).float().cpu()  # (steps, parts)
        if (bad := (~torch.isfinite(rows)).any(dim=1)).any():
            i = int(bad.nonzero()[0])
            parts = ", ".join(f"{n}={v:.4g}" for n, v in zip(names, rows[i].tolist()))
            kept = f" The last good checkpoint is kept in {checkpoint}." if checkpoint and Path(checkpoint).exists() else ""
            raise FloatingPointError(f"non-finite loss in {stage}, epoch {pending[i][0] + 1} step {pending[i][1] + 1}: "
                                     f"{parts}.{kept} Lower the learning rate or check the inputs for NaN.")
        for name, column in zip(names, rows.T.tolist()):
            getattr(hist, name).extend(column)
        pending.clear()

    def save(epoch: int, step: int) -> None:  # rank 0 writes; the pending losses are read back first
        read_back()
        # the ranks' mean statistics, so that a resumed run starts every rank where this one's mean stands: the
        # moving average is linear, so the final averaged statistics change by rounding only
        ddp.average_buffers(net)
        state.update(epoch=epoch, step=step, history=asdict(hist))
        if checkpoint is not None and ddp.is_main():
            save_state(checkpoint, {**state, "model": net.state_dict(), "optimizer": opt.state_dict(),
                                    "scheduler": sched.state_dict(), "rng": torch.get_rng_state(),
                                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None})

    with _stop_signals(checkpoint is not None) as flag:
        for epoch in range(state["epoch"], epochs):
            model.train()
            if fine and strategy.startswith("frozen-bn"):  # BatchNorm in eval mode: running statistics, no coupling
                freeze_bn(net)
            desc = f"{stage} {epoch + 1}/{epochs}"
            for step in tqdm(range(state["step"], steps), desc=desc, disable=not progress, leave=False,
                             initial=state["step"], total=steps):
                idx = sup.batch(epoch, step)
                xs, ys = _take(x_sup, idx, cfg), y_sup[idx].to(cfg.device)
                xu = _take(x_unsup, unsup.batch_at(epoch * steps + step), cfg) if fine else None
                if official:  # ---- Step A: CE, F2 on detached features (concat-both: the unlabeled rows too) ----
                    with autocast():
                        loss_a = step_a_loss(model, xs, ys, xu if strategy == "concat-both" else None)
                    opt.zero_grad(set_to_none=True)
                    loss_a.backward()
                    opt.step()
                with autocast():
                    if fine:  # ---- Step B: CE on both heads + discrepancy loss on an unlabeled batch ----
                        loss, parts = step_b_loss(model, xs, ys, xu, strategy, cfg.margin)
                        record = [parts["ce"], parts["dis"], parts["gap"]] + ([loss_a.detach()] if official else [])
                    else:  # ---- pre-training step: CE(F1) + CE(F2) ----
                        loss = supervised_loss(*model(xs), ys)
                        record = [loss.detach()]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                pending.append((epoch, step, torch.stack(record)))  # stays on the device: no sync
                # ---- the stop agreed over the ranks; every N steps: losses checked, checkpoint ----
                signum = ddp.reduce_max(flag["signal"], cfg.device)
                if signum or (cfg.checkpoint_every and (epoch * steps + step + 1) % cfg.checkpoint_every == 0):
                    save(epoch, step + 1)
                if signum:
                    raise TrainingInterrupted(f"{signal.Signals(signum).name} in {desc} step {step + 1}/{steps}; saved in "
                                              f"{checkpoint}.", signum)
            # ---- epoch end: losses checked, lr decay, the ranks' mean BatchNorm statistics, validation AUROC ----
            read_back()
            sched.step()
            ddp.average_buffers(net)
            if fine:
                scores = [discrepancy_score(*ddp.gather(lambda t: predict_logits(net, t, cfg.eval_batch_size, cfg.device), v))
                          for v in (split.val_id_x, split.val_ood_x)]  # the whole validation split, on every rank
                hist.val_auroc.append(ood_metrics(*scores)["auroc"])
                if hist.val_auroc[-1] > state["best_auroc"]:
                    state.update(best_auroc=hist.val_auroc[-1], best={k: v.detach().clone() for k, v in net.state_dict().items()})
                if on_epoch is not None:
                    on_epoch(epoch, hist)
            save(epoch + 1, 0)
            if signum := ddp.reduce_max(flag["signal"], cfg.device):  # agreed: no rank goes on alone
                raise TrainingInterrupted(f"{signal.Signals(signum).name} at the end of {desc}; saved in "
                                          f"{checkpoint}.", signum)
            state["step"] = 0
    last = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"history": hist, "best": state["best"] if state["best"] is not None else last, "last": last}
