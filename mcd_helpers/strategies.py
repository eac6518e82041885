"""How a training step feeds its batches to the model: layouts, the strategy table, one MCD
iteration.

The project's question: a model trained on two inputs in one step (a labeled and an unlabeled
batch) can see them in one forward of their concatenation, the outputs split by rows
(``"concat"``), or in one forward each (``"separate"``), followed by one backward. The two give the
same loss and gradients, up to rounding, exactly when no layer couples the samples of a batch;
train-mode BatchNorm does (notebook 02).

* **Layouts** (:data:`LAYOUTS`, :func:`forward_batches`): how ``k`` batches go through the model.
* **The strategy table** (:data:`STRATEGIES`, :func:`get_strategy`): for each MCD fine-tuning
  strategy, how Step A and Step B feed their batches, what BatchNorm does while fine-tuning, and
  which statistics the evaluation uses. The loop, the stages, the config check, the report and the
  notebooks read it; a new strategy is one row.
* **One MCD iteration** (:func:`mcd_step`), as the official code does it (github.com/YU1ut/UOOD-MCD
  ``solver.py``): Step A (:func:`step_a_loss`), an optimizer step, then Step B
  (:func:`step_b_loss`) and another optimizer step.
"""

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .losses import step_b_objective, supervised_loss
from .norms import eval_mode_bn, has_sources, use_source

# ---- layouts: k batches through one model --------------------------------------------------------

LAYOUTS = ("concat", "separate", "interleave", "mixed", "chunks")


def split_rows(output, sizes: Sequence[int]) -> list:
    """Split the output of one forward of a concatenation back into one output per batch.

    ``output`` is a tensor ``(sum(sizes), ...)`` or a tuple/list of them (each is split, so a
    two-head model's ``(logits1, logits2)`` gives one ``(logits1_i, logits2_i)`` per batch).

    Raises:
        TypeError: an output that is neither a tensor nor a flat tuple of tensors.
        ValueError: a first axis that is not the total batch size (the model mixes rows).
    """
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != sum(sizes):
            raise ValueError(
                f"the model's output {tuple(output.shape)} cannot be split by rows into batches of "
                f"{tuple(sizes)}: its first axis must be the total batch size {sum(sizes)}."
            )
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        return [output[end - n : end] for n, end in zip(sizes, ends)]  # slices (SliceBackward0)
    if (
        isinstance(output, (tuple, list))
        and output
        and all(isinstance(t, torch.Tensor) for t in output)
    ):
        # one tuple (t_1[rows_i], t_2[rows_i], ...) per batch
        return list(zip(*(split_rows(t, sizes) for t in output)))
    if isinstance(output, (tuple, list)):
        got = [type(t).__name__ for t in output]
    else:
        got = type(output).__name__
    raise TypeError(f"the model's output must be a tensor or a flat tuple of tensors, got {got}.")


def interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    """FixMatch's interleave (kekmodel/FixMatch-pytorch ``train.py``): row ``j * size + i`` goes to
    position ``i * (N / size) + j``; for ``x = cat`` of ``size`` equal parts whose length ``size``
    divides, each contiguous chunk of the result holds an equal share of every part.

    Shapes: ``(N, ...)`` with ``N`` divisible by ``size`` -> ``(N, ...)``.

    Raises:
        ValueError: ``N`` not divisible by ``size``, or ``size < 1``.
    """
    if size < 1 or len(x) % size:
        raise ValueError(f"interleave needs N = {len(x)} divisible by size = {size} (size >= 1).")
    return x.reshape(-1, size, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[1:])


def de_interleave(x: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of :func:`interleave`. Raises ``ValueError`` when ``N`` is not divisible by
    ``size``."""
    if size < 1 or len(x) % size:
        raise ValueError(
            f"de_interleave needs N = {len(x)} divisible by size = {size} (size >= 1)."
        )
    return x.reshape(size, -1, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[1:])


def _chunked(model: nn.Module, x: torch.Tensor, k: int, **kw):
    """``model`` on ``k`` contiguous chunks of ``x``, the outputs concatenated back (``k``
    "devices")."""
    outputs = [model(chunk, **kw) for chunk in x.chunk(k)]
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs))  # (logits1, logits2) of every chunk


def _rows(output, index: torch.Tensor):
    """``output[index]`` of a tensor or of each tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output[index]
    return tuple(t[index] for t in output)


def forward_batches(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    layout: str = "separate",
    generator: torch.Generator | None = None,
    **kw,
) -> list:
    """The model's output for each batch, the batches laid out into forwards by ``layout``.

    * ``"concat"``: one forward of ``torch.cat(batches)``, the output split back by rows;
    * ``"separate"``: one forward per batch; batch ``i`` uses source ``i``'s statistics when the
      model has per-source BatchNorm (:func:`mcd_helpers.norms.per_source_batchnorm`);
    * ``"interleave"``: :func:`interleave`, ``k`` forwards of contiguous chunks,
      :func:`de_interleave` (MixMatch on one device; FixMatch's single forward split over ``k``
      data-parallel devices): each forward holds an equal share of every batch;
    * ``"mixed"``: all rows shuffled together (``generator``), ``k`` forwards of random mixtures;
    * ``"chunks"``: ``k`` forwards of contiguous chunks of the concatenation, without interleaving.

    ``kw`` goes to every forward (``detach_f2=True`` in Step A).

    Shapes:
        batches: ``[(N_1, ...), ..., (N_k, ...)]`` -> ``k`` outputs, output ``i`` with ``N_i`` rows.

    Raises:
        ValueError: an unknown layout; batches of unequal sizes for ``"interleave"`` or
        ``"chunks"``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}.")
    if layout == "separate":
        outputs = []
        for i, x in enumerate(batches):
            # per-source BatchNorm: batch i with statistics i (else a no-op)
            with use_source(model, i):
                outputs.append(model(x, **kw))
        return outputs
    sizes, k = [len(x) for x in batches], len(batches)
    x = torch.cat(list(batches))  # (sum N_i, ...)
    if layout == "concat":
        return split_rows(model(x, **kw), sizes)
    if layout == "mixed":
        order = torch.randperm(len(x), generator=generator)
        back = torch.argsort(order)  # rows back in batch order
        return split_rows(_rows(_chunked(model, x[order], k, **kw), back), sizes)
    if len(set(sizes)) != 1:
        raise ValueError(f"layout {layout!r} needs batches of equal size, got {sizes}.")
    if layout == "chunks":
        return split_rows(_chunked(model, x, k, **kw), sizes)
    out = _chunked(model, interleave(x, k), k, **kw)
    if isinstance(out, torch.Tensor):
        return split_rows(de_interleave(out, k), sizes)
    return split_rows(tuple(de_interleave(t, k) for t in out), sizes)


# ---- the strategy table -------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """One row of :data:`STRATEGIES`: how an MCD fine-tuning iteration feeds its batches.

    Attributes:
        name: the strategy's name, as in ``--strategies`` and in every result row.
        step_a: Step A's forward: ``"labeled"`` (the labeled batch alone, as the official code) or
            ``"with-unlabeled"`` (one forward of labeled + unlabeled, the loss on the labeled rows).
        step_b: Step B's layout of the labeled and the unlabeled batch (:data:`LAYOUTS`).
        batchnorm: BatchNorm while fine-tuning: ``"train"`` (batch statistics; the running ones
            updated), ``"per-source"`` (train mode, running statistics kept per source),
            ``"detached-stats"`` (train mode, no gradient through the batch statistics:
            :func:`~mcd_helpers.norms.detached_stats_batchnorm`) or ``"eval"`` (the running
            statistics, never updated: no sample is coupled to another).
        eval_stats: the statistics the evaluation uses: ``"running"`` (the network's own),
            ``"per-source"`` (the labeled source's) or ``"recalibrated"`` (recomputed on labeled ID
            data after fine-tuning).
        trains_as: the strategy whose fine-tuning run this one shares (``recalibrate`` evaluates
            ``separate``'s network with other statistics).
        about: one line for tables and the command line's help.
    """

    name: str
    step_a: str
    step_b: str
    batchnorm: str
    eval_stats: str
    trains_as: str
    about: str

    @property
    def needs_batchnorm(self) -> bool:
        """Whether the strategy only means something on a network with BatchNorm."""
        return self.batchnorm != "train" or self.eval_stats != "running"


# fmt: off
STRATEGIES = {
    s.name: s
    for s in (
        Strategy("separate", "labeled", "separate", "train", "running", "separate",
                 "two forwards in Step B, as the official code"),
        Strategy("concat", "labeled", "concat", "train", "running", "concat",
                 "one forward of the concatenation in Step B"),
        Strategy("split-bn", "labeled", "separate", "per-source", "per-source", "split-bn",
                 "separate, running statistics per source; evaluated with the labeled source's"),
        Strategy("recalibrate", "labeled", "separate", "train", "recalibrated", "separate",
                 "separate's network, statistics recomputed on labeled ID data"),
        Strategy("concat-both", "with-unlabeled", "concat", "train", "running", "concat-both",
                 "concat, and Step A also forwards the unlabeled batch"),
        Strategy("eval-bn", "labeled", "separate", "eval", "running", "eval-bn",
                 "separate with BatchNorm in eval mode while fine-tuning (no coupling)"),
        Strategy("eval-bn-concat", "labeled", "concat", "eval", "running", "eval-bn-concat",
                 "concat with BatchNorm in eval mode: the same network as eval-bn"),
        Strategy("interleave", "labeled", "interleave", "train", "running", "interleave",
                 "two forwards in Step B, each half labeled and half unlabeled (FixMatch's)"),
        Strategy("separate-detached", "labeled", "separate", "detached-stats", "running",
                 "separate-detached", "separate, no gradient through BatchNorm's batch statistics"),
        Strategy("concat-detached", "labeled", "concat", "detached-stats", "running",
                 "concat-detached", "concat, no gradient through BatchNorm's batch statistics"),
    )
}
# fmt: on
# Step A then Step B each iteration | Step B only (the blog's)
SCHEDULES = ("official", "step_b")


def get_strategy(name: str) -> Strategy:
    """The row of :data:`STRATEGIES` called ``name``. Raises ``ValueError`` naming the valid
    ones."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {name!r}.")
    return STRATEGIES[name]


def train_mode(model: nn.Module, name: str) -> nn.Module:
    """``model.train()``, with BatchNorm in eval mode where strategy ``name`` fine-tunes so."""
    model.train()
    if get_strategy(name).batchnorm == "eval":
        eval_mode_bn(model)
    return model


# ---- one MCD iteration ---------------------------------------------------------------------------


def step_a_loss(
    model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor | None = None
) -> torch.Tensor:
    """Official Step A: CE(F1(G(x))) + CE(F2(G(x).detach())) on the labeled batch, in nats.

    Only CE(F1) reaches G: F2 learns on detached features. One forward ``model(x, detach_f2=True)``,
    so a DistributedDataParallel wrapper sees it. With ``x_unsup`` (Step A ``"with-unlabeled"``,
    strategy ``concat-both``) one forward of ``torch.cat([x_sup, x_unsup])``, the loss on the
    labeled rows alone: the unlabeled rows only share BatchNorm's batch statistics.

    Shapes: x_sup ``(N, C, H, W)``, y_sup ``(N,)``, x_unsup ``(M, C, H, W)`` -> scalar.
    """
    if x_unsup is None:  # the labeled batch alone (source 0 of a per-source BatchNorm)
        outputs = forward_batches(model, [x_sup], "separate", detach_f2=True)
    else:
        outputs = forward_batches(model, [x_sup, x_unsup], "concat", detach_f2=True)
    return supervised_loss(*outputs[0], y_sup)


def step_b_loss(
    model: nn.Module,
    x_sup: torch.Tensor,
    y_sup: torch.Tensor,
    x_unsup: torch.Tensor,
    strategy: str = "separate",
    margin: float = 1.2,
) -> tuple[torch.Tensor, dict]:
    """Step B: CE(F1) + CE(F2) on ``x_sup`` + the discrepancy loss on ``x_unsup`` (nats), the two
    batches laid out as the strategy says (its ``step_b``).

    Shapes:
        x_sup: ``(N_sup, C, H, W)``, y_sup: ``(N_sup,)`` in ``[0, K)``, x_unsup:
        ``(N_unsup, C, H, W)``.

    Returns:
        ``(loss, parts)`` of :func:`mcd_helpers.losses.step_b_objective` (``ce``, ``dis``, ``gap``).

    Raises:
        ValueError: an unknown strategy, ``"split-bn"`` without per-source BatchNorm, bad labels.
    """
    row = get_strategy(strategy)
    if row.batchnorm == "per-source" and not has_sources(model):
        raise ValueError(
            f"{row.name!r} needs per-source BatchNorm: use "
            "mcd_helpers.norms.per_source_batchnorm(model)."
        )
    outputs = forward_batches(model, [x_sup, x_unsup], row.step_b)
    return step_b_objective(outputs, y_sup, margin)


def mcd_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_sup: torch.Tensor,
    y_sup: torch.Tensor,
    x_unsup: torch.Tensor,
    strategy: str = "separate",
    margin: float = 1.2,
    schedule: str = "official",
    autocast: Callable = contextlib.nullcontext,
) -> dict[str, torch.Tensor]:
    """One MCD fine-tuning iteration: Step A, then Step B, each with its own optimizer step.

    The official ``solver.py`` steps three SGD optimizers (G, F1, F2); one SGD over all parameters
    takes the same steps (Step A's F2 loss reaches F2 alone). ``schedule="step_b"`` skips Step A
    (the seed blog's and the unofficial reproduction's loop). ``autocast``: a context factory for
    mixed precision, e.g. ``lambda: torch.autocast("cpu", torch.bfloat16)``.

    Shapes: x_sup ``(N, C, H, W)``, y_sup ``(N,)``, x_unsup ``(M, C, H, W)``.

    Returns:
        the iteration's losses in nats, detached and on the device (reading them is a host sync):
        ``ce``, ``dis`` and ``gap`` of Step B, and ``step_a`` under the official schedule.
    """
    row = get_strategy(strategy)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}.")
    losses = {}
    if schedule == "official":  # ---- Step A: CE on the labeled batch; F2 on detached features ----
        with autocast():
            loss_a = step_a_loss(
                model, x_sup, y_sup, x_unsup if row.step_a == "with-unlabeled" else None
            )
        optimizer.zero_grad(set_to_none=True)
        loss_a.backward()
        optimizer.step()
        losses["step_a"] = loss_a.detach()
    # ---- Step B: CE on both heads (labeled) + the discrepancy loss (unlabeled), one backward ----
    with autocast():
        loss_b, parts = step_b_loss(model, x_sup, y_sup, x_unsup, row.name, margin)
    optimizer.zero_grad(set_to_none=True)
    loss_b.backward()
    optimizer.step()
    return {**parts, **losses}
