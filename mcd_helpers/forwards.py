"""How a step's batches go through the model, and the two losses of one MCD iteration.

Official fine-tuning (github.com/YU1ut/UOOD-MCD ``solver.py``), each iteration:

* **Step A** (:func:`step_a_loss`): CE on a labeled batch; F2 sees G's features detached.
* **Step B** (:func:`step_b_loss`): CE(F1) + CE(F2) on the labeled batch + the discrepancy loss
  on an unlabeled batch; one backward, one optimizer step.

``strategy`` (:data:`STRATEGIES`) says how Step B feeds its two batches to the model:

* ``"separate"``: two forwards, ``model(x_sup)`` and ``model(x_unsup)`` (the official code);
* ``"concat"``: one forward of ``torch.cat([x_sup, x_unsup])``, the outputs split by rows;
* ``"split-bn"``: separate forwards through per-source BatchNorm (labeled = source 0, unlabeled =
  source 1, :func:`mcd_helpers.norms.per_source_batchnorm`); evaluation uses source 0;
* ``"recalibrate"``: ``separate``; after fine-tuning the pipeline recomputes the running
  statistics on labeled ID data (:func:`mcd_helpers.norms.recalibrate_bn`);
* ``"concat-both"``: ``concat``, and Step A also forwards ``torch.cat([x_sup, x_unsup])`` (its loss on
  the labeled rows), so that every BatchNorm update of the iteration sees both streams;
* ``"frozen-bn"`` / ``"frozen-bn-concat"``: ``separate`` / ``concat`` with BatchNorm in eval mode
  during fine-tuning (:func:`mcd_helpers.norms.freeze_bn`): no coupling, so the two train the same
  network up to float rounding; the same-network control.

Concat and separate give the same loss and gradients exactly when no layer couples the samples of
a batch; train-mode BatchNorm does (notebook 02).
"""

from typing import Sequence

import torch
from torch import nn

from .losses import step_b_objective, supervised_loss
from .norms import has_sources, use_source

STRATEGIES = ("separate", "concat", "split-bn", "recalibrate", "concat-both", "frozen-bn", "frozen-bn-concat")
CONCAT = ("concat", "concat-both", "frozen-bn-concat")  # Step B forwards torch.cat([x_sup, x_unsup])
BN_ONLY = ("split-bn", "recalibrate", "frozen-bn", "frozen-bn-concat")  # need BatchNorm (norm="batch")


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
            raise ValueError(f"the model's output {tuple(output.shape)} cannot be split by rows into batches of "
                             f"{tuple(sizes)}: its first axis must be the total batch size {sum(sizes)}.")
        return [output[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))]  # slices (SliceBackward0)
    if isinstance(output, (tuple, list)) and output and all(isinstance(t, torch.Tensor) for t in output):
        return list(zip(*(split_rows(t, sizes) for t in output)))  # one tuple (t_1[rows_i], t_2[rows_i], ...) per batch
    got = [type(t).__name__ for t in output] if isinstance(output, (tuple, list)) else type(output).__name__
    raise TypeError(f"the model's output must be a tensor or a flat tuple of tensors, got {got}.")


def forward_outputs(model: nn.Module, batches: Sequence[torch.Tensor], strategy: str, **kw) -> list:
    """The model's output for each batch, by ``"concat"`` (one forward of ``torch.cat(batches)``, split
    by rows) or ``"separate"`` (one forward per batch; batch ``i`` with source ``i``'s statistics when
    the model has per-source BatchNorm). ``kw`` goes to every forward (``detach_f2=True`` in Step A).

    Shapes:
        batches: ``[(N_1, ...), ..., (N_k, ...)]`` -> ``k`` outputs, output ``i`` with ``N_i`` rows.
    """
    if strategy == "concat":
        return split_rows(model(torch.cat(list(batches)), **kw), [len(x) for x in batches])  # (sum N_i, ...) split
    if strategy != "separate":
        raise ValueError(f"strategy must be 'concat' or 'separate', got {strategy!r}.")
    outs = []
    for i, x in enumerate(batches):
        with use_source(model, i):  # per-source BatchNorm: batch i with statistics i (else a no-op)
            outs.append(model(x, **kw))
    return outs


def check_strategy(strategy: str) -> str:
    """``strategy`` if it is one of :data:`STRATEGIES`, else ``ValueError`` naming them."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}.")
    return strategy


def step_b_loss(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor,
                strategy: str = "separate", margin: float = 1.2) -> tuple[torch.Tensor, dict]:
    """Step B: CE(F1) + CE(F2) on ``x_sup`` + the discrepancy loss on ``x_unsup`` (nats), the batches fed by
    ``strategy``.

    Shapes:
        x_sup: ``(N_sup, C, H, W)``, y_sup: ``(N_sup,)`` in ``[0, K)``, x_unsup: ``(N_unsup, C, H, W)``.

    Returns:
        ``(loss, parts)`` of :func:`mcd_helpers.losses.step_b_objective` (``ce``, ``dis``, ``gap``).

    Raises:
        ValueError: an unknown strategy, ``"split-bn"`` without per-source BatchNorm, bad labels.
    """
    if check_strategy(strategy) == "split-bn" and not has_sources(model):
        raise ValueError("'split-bn' needs per-source BatchNorm: use mcd_helpers.norms.per_source_batchnorm(model).")
    outputs = forward_outputs(model, [x_sup, x_unsup], "concat" if strategy in CONCAT else "separate")
    return step_b_objective(outputs, y_sup, margin)


def step_a_loss(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor | None = None) -> torch.Tensor:
    """Official Step A: CE(F1(G(x))) + CE(F2(G(x).detach())), nats; only CE(F1) reaches G.

    One forward ``model(x_sup, detach_f2=True)``, so a DistributedDataParallel wrapper sees it; with
    ``x_unsup`` (strategy ``"concat-both"``) one forward of ``torch.cat([x_sup, x_unsup])``, the loss on
    the labeled rows alone (the unlabeled rows only share BatchNorm's batch statistics).
    Shapes: x_sup ``(N, C, H, W)``, y_sup ``(N,)``, x_unsup ``(M, C, H, W)`` -> scalar.
    """
    if x_unsup is not None:
        return supervised_loss(*forward_outputs(model, [x_sup, x_unsup], "concat", detach_f2=True)[0], y_sup)
    with use_source(model, 0):
        return supervised_loss(*model(x_sup, detach_f2=True), y_sup)
