"""Concatenated vs separate forwards: run one MCD Step B both ways and report every difference.

The question of the blog post that started this project: when one model sees a labeled batch
``x_sup`` and an unlabeled batch ``x_unsup`` in one training step, is

* ``"concat"``: one forward of ``torch.cat([x_sup, x_unsup])``, outputs split by rows, and
* ``"separate"``: two forwards ``model(x_sup)``, ``model(x_unsup)``, then one backward

the same? Each forward builds its own autograd graph; the graphs meet at the shared parameters'
``AccumulateGrad`` nodes, so the gradients add up. The two strategies are therefore equal (up to
float rounding) exactly when every layer treats each sample on its own in the current mode.
Train-mode BatchNorm does not: it normalises with the statistics of the batch it sees, and
updates its running statistics once per forward (see notebook 02).

* :func:`compare_strategies` -- loss, gradients and buffers of both strategies on deep copies.
* :func:`coupling_matrix` -- how much each sample's output depends on each sample's input.
* :func:`step_cost` -- time per step and peak memory of one strategy.

The loss is Step B's (CE(F1) + CE(F2) + discrepancy loss), as in :func:`mcd_helpers.steps.step_b_loss`;
:func:`mcd_helpers.teaching.forwards.compare_forwards` is the same comparison for any number of batches and any loss.
"""
from __future__ import annotations

import copy
import html
import time
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from .forwards import ForwardsComparison, _report, default_tolerance, forward_outputs, model_dtype_device, run_both
from ..losses import discrepancy_loss, entropy, supervised_loss

__all__ = ["StrategyComparison", "compare_strategies", "ComparisonTable", "coupling_matrix", "StepCost",
           "step_cost", "default_tolerance"]


@dataclass(kw_only=True)
class StrategyComparison(ForwardsComparison):
    """One MCD Step B computed with ``"concat"`` and with ``"separate"`` forwards.

    A :class:`~mcd_helpers.teaching.forwards.ForwardsComparison` of the two batches ``[x_sup, x_unsup]``
    with the Step B loss (CE1 + CE2 + discrepancy loss, nats) as ``loss_fn``, plus:

    Attributes:
        parts_concat, parts_separate: ``{"ce", "dis", "gap"}`` of each strategy (nats, floats).
        n_sup, n_unsup: the two batch sizes.
    """
    parts_concat: dict[str, float]
    parts_separate: dict[str, float]
    n_sup: int
    n_unsup: int

    def _loss_rows(self) -> list[tuple[str, str, str, str]]:
        return [("loss (nats)", f"{self.loss_concat:.10g}", f"{self.loss_separate:.10g}", f"{self.loss_diff:.3g}")]

    def _head(self) -> str:
        mode = "train" if self.training else "eval"
        return (f"concat vs separate forwards: {mode} mode, {str(self.dtype).replace('torch.', '')}, "
                f"{self.n_sup} labeled + {self.n_unsup} unlabeled")


class ComparisonTable:
    """Several :class:`StrategyComparison` results side by side, one row per label.

    Columns: mode, dtype, batch sizes, |Δloss|, max |Δgrad|, max |Δ| of the running
    statistics, the ``num_batches_tracked`` increments (concat vs separate), verdict.
    Prints as text; shows as an HTML table in Jupyter.
    """

    def __init__(self, comparisons: Mapping[str, ForwardsComparison]):
        if not comparisons:
            raise ValueError("ComparisonTable needs at least one comparison.")
        self.comparisons = dict(comparisons)

    def rows(self) -> list[tuple[str, ...]]:
        out = [("setting", "mode", "dtype", "batch sizes", "|Δloss|", "max |Δgrad|",
                "max |Δrunning stats|", "num_batches_tracked", "verdict")]
        for label, c in self.comparisons.items():
            inc = c.tracked_increments
            out.append((label, "train" if c.training else "eval", str(c.dtype).replace("torch.", ""),
                        "+".join(str(n) for n in c.batch_sizes), f"{c.loss_diff:.2g}", f"{c.max_grad_diff:.2g}",
                        f"{c.max_running_stat_diff:.2g}", "-" if inc is None else f"+{inc[0]} vs +{inc[1]}",
                        "same" if c.same else "DIFFERENT"))
        return out

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        rows = self.rows()
        w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)

    def _repr_html_(self) -> str:
        head, *body = self.rows()
        th = "".join(f"<th>{html.escape(c)}</th>" for c in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
        return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _check_batches(x_sup, y_sup, x_unsup) -> None:
    for name, t in (("x_sup", x_sup), ("y_sup", y_sup), ("x_unsup", x_unsup)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if x_sup.dim() == 0 or x_unsup.dim() == 0:
        raise ValueError("x_sup and x_unsup must be batches (N, ...), got a 0-d tensor.")
    if x_sup.shape[1:] != x_unsup.shape[1:]:
        raise ValueError(f"x_sup {tuple(x_sup.shape)} and x_unsup {tuple(x_unsup.shape)} must agree "
                         "in every axis but the first (batch), or they cannot be concatenated.")
    if len(x_sup) == 0 or len(x_unsup) == 0:
        raise ValueError(f"both batches need at least one sample, got {len(x_sup)} labeled and "
                         f"{len(x_unsup)} unlabeled.")
    if y_sup.shape != (len(x_sup),):
        raise ValueError(f"y_sup must have shape ({len(x_sup)},) to match x_sup, got {tuple(y_sup.shape)}.")


def _step_b_loss_fn(y_sup: torch.Tensor, margin: float, record: list | None = None):
    """``loss_fn`` of MCD's Step B over ``[(logits1_sup, logits2_sup), (logits1_unsup, logits2_unsup)]``:
    CE(F1) + CE(F2) + discrepancy loss (nats), the operations of :func:`mcd_helpers.steps.step_b_loss`.
    Appends ``{"ce", "dis", "gap"}`` of each call to ``record``."""

    def step_b(outputs: list) -> torch.Tensor:
        try:
            (logits1_sup, logits2_sup), (logits1_unsup, logits2_unsup) = outputs  # (N_i, K) each
        except (TypeError, ValueError) as err:
            raise TypeError("the model's forward must return two tensors (logits1, logits2), each "
                            f"(N, K); unpacking its output failed: {err}") from err
        ce = supervised_loss(logits1_sup, logits2_sup, y_sup)
        dis = discrepancy_loss(logits1_unsup, logits2_unsup, margin)
        if record is not None:
            with torch.no_grad():
                gap = (entropy(logits1_unsup) - entropy(logits2_unsup)).mean()
            record.append({"ce": float(ce.detach()), "dis": float(dis.detach()), "gap": float(gap)})
        return ce + dis

    return step_b


def compare_strategies(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor,
                       margin: float = 1.2, dtype: torch.dtype | None = None, seed: int = 0) -> StrategyComparison:
    """Compute one MCD Step B loss and its gradients with concatenated and with separate forwards.

    The two-batch MCD case of :func:`~mcd_helpers.teaching.forwards.compare_forwards`: batches
    ``[x_sup, x_unsup]``, loss CE(F1) + CE(F2) on ``x_sup`` plus the discrepancy loss on
    ``x_unsup``, the same operations as :func:`mcd_helpers.steps.step_b_loss`. Works on any
    module whose ``forward`` returns ``(logits1, logits2)``. Each strategy runs on its own
    ``copy.deepcopy`` of ``model`` (gradients cleared), in the model's current train/eval mode, so
    the caller's parameters, buffers, ``.grad`` and global RNG state are untouched. Dropout draws
    its masks from one random stream seeded with ``seed`` (concat first, then separate), as two
    training runs would: the masks differ between the strategies.

    Equal up to rounding when no layer couples samples (no train-mode BatchNorm, no dropout
    with p > 0 in train mode); in float64 the gradients then agree to ~1e-16 per entry.

    Args:
        model: the two-head model (not modified).
        x_sup: labeled batch ``(N_sup, ...)``; y_sup: its labels ``(N_sup,)`` in ``[0, K)``.
        x_unsup: unlabeled batch ``(N_unsup, ...)``, same trailing shape as ``x_sup``.
        margin: the discrepancy loss's margin m (nats), as in :func:`~mcd_helpers.steps.step_b_loss`.
        dtype: run the copies (and inputs) in this floating dtype, e.g. ``torch.float64`` for
            tight checks; default: the model's own dtype. Inputs are moved to the model's device.
        seed: seed of the dropout masks.

    Returns:
        a :class:`StrategyComparison` (prints as a table; an HTML table in Jupyter).

    Raises:
        TypeError: if an input is not a tensor or ``forward`` does not return two tensors.
        ValueError: on empty batches, batches that cannot be concatenated, labels of the wrong
            shape, or (from the losses) labels outside ``[0, K)`` or a negative margin; PyTorch's
            train-mode ``BatchNorm1d`` also raises one for a batch of a single sample.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    _check_batches(x_sup, y_sup, x_unsup)
    y_sup = y_sup.to(model_dtype_device(model)[1])
    parts: list[dict[str, float]] = []  # concat's, then separate's
    step_b = _step_b_loss_fn(y_sup, margin, parts)

    try:
        results, dtype, buffers_before = run_both(model, [x_sup, x_unsup], step_b, dtype, seed)
    except TypeError as err:
        if "tuple of tensors" in str(err):
            raise TypeError("the model's forward must return two tensors (logits1, logits2), each "
                            f"(N, K): {err}") from err
        raise
    return _report(StrategyComparison, results, dtype, buffers_before, model.training, (len(x_sup), len(x_unsup)),
                   parts_concat=parts[0], parts_separate=parts[1],
                   n_sup=len(x_sup), n_unsup=len(x_unsup))


def coupling_matrix(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Cross-sample coupling of a batch: ``C[i, j] = ||d out_i / d x_j||_F``.

    ``out_i`` is sample i's output, both heads' logits side by side ``(2K,)``; ``x_j`` sample j's
    input. Per-sample layers give a diagonal matrix (exact zeros off the diagonal); train-mode
    BatchNorm fills it, because every output depends on the batch mean and variance. Runs on a
    deep copy in the model's mode (the caller's running statistics are untouched); one backward
    per output entry, so keep ``N`` small (N * 2K backward passes).

    Shapes:
        x: ``(N, ...)`` -> ``(N, N)`` float64 on the CPU; row i = output sample, column j = input sample.

    Raises:
        ValueError: if ``x`` has fewer than 1 sample.
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or len(x) < 1:
        raise ValueError("x must be a batch tensor (N, ...) with N >= 1.")
    m = copy.deepcopy(model)
    dtype, device = model_dtype_device(m)
    x = x.detach().to(device, dtype).requires_grad_(True)
    logits1, logits2 = m(x)
    out = torch.cat([logits1, logits2], dim=1)  # (N, 2K)
    n, width = out.shape
    sq = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for k in range(width):
            (g,) = torch.autograd.grad(out[i, k], x, retain_graph=True)  # (N, ...)
            sq[i] += g.detach().double().flatten(1).pow(2).sum(1).cpu()
    return sq.sqrt()


@dataclass
class StepCost:
    """Cost of one training step (forward(s), backward, SGD step) of one strategy.

    ``ms_per_step``: median wall time in milliseconds (CUDA-synchronised on GPU).
    ``peak_bytes``: on CUDA, ``torch.cuda.max_memory_allocated`` during the step; on the CPU,
    the bytes of the distinct tensors the autograd graph saves for backward (activations, and the
    weights they meet), which dominate a training step's extra memory. ``device``: where it ran.
    """
    strategy: str
    ms_per_step: float
    peak_bytes: int
    device: str


def step_cost(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor,
              strategy: str, repeats: int = 5, margin: float = 1.2) -> StepCost:
    """Measure time per step and peak memory of ``strategy`` on a deep copy of ``model``.

    The copy is trained with SGD (lr 0.01) for ``1 + repeats`` steps (the first is a warm-up and
    not timed); inputs are moved to the model's device.

    Raises:
        ValueError: on ``repeats < 1`` or an unknown strategy.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    if strategy not in ("concat", "separate"):
        raise ValueError(f"strategy must be 'concat' or 'separate', got {strategy!r}.")
    m = copy.deepcopy(model)
    dtype, device = model_dtype_device(m)
    x_sup, x_unsup, y_sup = x_sup.to(device, dtype), x_unsup.to(device, dtype), y_sup.to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    step_b = _step_b_loss_fn(y_sup, margin)
    cuda = device.type == "cuda"
    saved: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Each saved tensor counted once, by the memory it views (not its whole storage: a batch
        # sliced from a big data tensor shares that tensor's storage).
        saved[t.data_ptr(), t.numel(), t.dtype] = t.numel() * t.element_size()
        return t

    times = []
    for i in range(1 + repeats):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        saved.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step_b(forward_outputs(m, [x_sup, x_unsup], strategy))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if cuda else sum(saved.values())
    times.sort()
    return StepCost(strategy, 1000 * times[len(times) // 2], int(peak), str(device))
