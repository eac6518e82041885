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

The loss is :func:`mcd_helpers.train.step_b_loss` (CE(F1) + CE(F2) + discrepancy loss).
"""
from __future__ import annotations

import copy
import html
import time
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from .train import step_b_loss

__all__ = ["StrategyComparison", "compare_strategies", "ComparisonTable", "coupling_matrix", "StepCost",
           "step_cost", "default_tolerance"]

_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}


def default_tolerance(dtype: torch.dtype) -> float:
    """Largest |difference| still called "equal up to rounding" for ``dtype`` (absolute).

    float64: 1e-10 (rounding is ~1e-16 per operation); float32: 1e-4 (rounding ~1e-7 per
    operation, summed over reductions of thousands of terms); half types: 1e-2 / 1e-1.
    """
    return _TOLERANCE.get(dtype, 1e-4)


@dataclass
class StrategyComparison:
    """One MCD Step B computed with ``"concat"`` and with ``"separate"`` forwards.

    Attributes:
        loss_concat, loss_separate: the Step B loss (CE1 + CE2 + discrepancy loss), nats.
        max_grad_diff: max over all parameters and entries of |grad_concat - grad_separate|.
        grad_diff: parameter name -> max |Δ| of its gradient (0.0 if neither strategy gave it one).
        buffer_diff: buffer name -> max |Δ| after the forwards (BatchNorm's ``running_mean``,
            ``running_var``, ``num_batches_tracked``; empty for a model without buffers).
        grad_scale: max |grad| over all parameters (concat), to read ``max_grad_diff`` against.
        parts_concat, parts_separate: ``{"ce", "dis", "gap"}`` of each strategy (nats, floats).
        buffers_before, buffers_concat, buffers_separate: buffer name -> tensor (CPU copies),
            before the step and after each strategy's forwards.
        training: the model's mode during the comparison; dtype: its floating dtype.
        n_sup, n_unsup: batch sizes; tolerance: the |Δ| still called equal (see ``same``).
    """
    loss_concat: float
    loss_separate: float
    max_grad_diff: float
    grad_diff: dict[str, float]
    buffer_diff: dict[str, float]
    grad_scale: float
    parts_concat: dict[str, float]
    parts_separate: dict[str, float]
    training: bool
    dtype: torch.dtype
    n_sup: int
    n_unsup: int
    tolerance: float
    buffers_before: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    buffers_concat: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    buffers_separate: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def loss_diff(self) -> float:
        """|loss_concat - loss_separate| in nats."""
        return abs(self.loss_concat - self.loss_separate)

    @property
    def max_buffer_diff(self) -> float:
        """Max |Δ| over all buffers (0.0 when the model has none)."""
        return max(self.buffer_diff.values(), default=0.0)

    @property
    def max_running_stat_diff(self) -> float:
        """Max |Δ| over floating buffers only (running_mean, running_var), 0.0 when there are none."""
        return max((d for name, d in self.buffer_diff.items() if self.buffers_before[name].is_floating_point()),
                   default=0.0)

    @property
    def tracked_increments(self) -> tuple[int, int] | None:
        """How much one step adds to ``num_batches_tracked`` ``(concat, separate)``, e.g. ``(1, 2)``
        in train mode (one update per forward); None when the model has no such buffer."""
        for name, before in self.buffers_before.items():
            if name.endswith("num_batches_tracked"):
                return (int(self.buffers_concat[name] - before), int(self.buffers_separate[name] - before))
        return None

    @property
    def same(self) -> bool:
        """True when loss, every gradient and every buffer agree to within ``tolerance``."""
        return max(self.loss_diff, self.max_grad_diff, self.max_buffer_diff) <= self.tolerance

    @property
    def verdict(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        if self.same:
            return f"same up to {dtype} rounding (all |Δ| <= {self.tolerance:g})"
        return f"different (largest |Δ| above the {dtype} tolerance {self.tolerance:g})"

    def top_params(self, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` parameters whose gradients differ most, largest first."""
        return sorted(self.grad_diff.items(), key=lambda kv: -kv[1])[:k]

    def _rows(self, k: int) -> list[tuple[str, str, str, str]]:
        rows = [("loss (nats)", f"{self.loss_concat:.10g}", f"{self.loss_separate:.10g}", f"{self.loss_diff:.3g}"),
                ("max |grad| / max |Δgrad|", f"{self.grad_scale:.3g}", "", f"{self.max_grad_diff:.3g}")]
        rows += [(f"grad {name}", "", "", f"{d:.3g}") for name, d in self.top_params(k)]
        for name, d in self.buffer_diff.items():
            if name.endswith("num_batches_tracked"):
                before = int(self.buffers_before[name])
                c, s = int(self.buffers_concat[name]) - before, int(self.buffers_separate[name]) - before
                rows.append((f"{name} (+ per step)", f"+{c}", f"+{s}", f"{d:g}"))
            elif d > 0 or len(self.buffer_diff) <= 2 * k:
                rows.append((f"buffer {name}", "", "", f"{d:.3g}"))
        return rows

    def __str__(self) -> str:
        mode = "train" if self.training else "eval"
        head = (f"concat vs separate forwards: {mode} mode, {str(self.dtype).replace('torch.', '')}, "
                f"{self.n_sup} labeled + {self.n_unsup} unlabeled -> {self.verdict}")
        rows = [("quantity", "concat", "separate", "|Δ|")] + self._rows(5)
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
        return "\n".join([head] + lines)

    def _repr_html_(self) -> str:
        mode = "train" if self.training else "eval"
        cells = "".join(
            "<tr>" + "".join(f"<td style='text-align:{'left' if i == 0 else 'right'}'>{html.escape(c)}</td>"
                             for i, c in enumerate(r)) + "</tr>" for r in self._rows(8))
        color = "green" if self.same else "firebrick"
        dtype = str(self.dtype).replace("torch.", "")
        return (f"<p><b>concat vs separate</b>: {mode} mode, {dtype}, "
                f"{self.n_sup} labeled + {self.n_unsup} unlabeled: "
                f"<b style='color:{color}'>{html.escape(self.verdict)}</b></p>"
                "<table><thead><tr><th>quantity</th><th>concat</th><th>separate</th><th>|Δ|</th></tr>"
                f"</thead><tbody>{cells}</tbody></table>")


class ComparisonTable:
    """Several :class:`StrategyComparison` results side by side, one row per label.

    Columns: mode, dtype, batch sizes, |Δloss| (nats), max |Δgrad|, max |Δ| of the running
    statistics, the ``num_batches_tracked`` increments (concat vs separate), verdict.
    Prints as text; shows as an HTML table in Jupyter.
    """

    def __init__(self, comparisons: Mapping[str, StrategyComparison]):
        if not comparisons:
            raise ValueError("ComparisonTable needs at least one comparison.")
        self.comparisons = dict(comparisons)

    def rows(self) -> list[tuple[str, ...]]:
        out = [("setting", "mode", "dtype", "N_sup+N_unsup", "|Δloss| (nats)", "max |Δgrad|",
                "max |Δrunning stats|", "num_batches_tracked", "verdict")]
        for label, c in self.comparisons.items():
            inc = c.tracked_increments
            out.append((label, "train" if c.training else "eval", str(c.dtype).replace("torch.", ""),
                        f"{c.n_sup}+{c.n_unsup}", f"{c.loss_diff:.2g}", f"{c.max_grad_diff:.2g}",
                        f"{c.max_running_stat_diff:.2g}", "-" if inc is None else f"+{inc[0]} vs +{inc[1]}",
                        "same" if c.same else "DIFFERENT"))
        return out

    def __str__(self) -> str:
        rows = self.rows()
        w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows)

    def _repr_html_(self) -> str:
        head, *body = self.rows()
        th = "".join(f"<th>{html.escape(c)}</th>" for c in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
        return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


def _model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype, t.device
    return torch.get_default_dtype(), torch.device("cpu")


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


def _max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        t = a if a is not None else b
        return float(t.detach().abs().max()) if t.numel() else 0.0
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().cpu().clone() for name, b in model.named_buffers()}


def compare_strategies(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor,
                       margin: float = 1.2, dtype: torch.dtype | None = None, seed: int = 0) -> StrategyComparison:
    """Compute one MCD Step B loss and its gradients with concatenated and with separate forwards.

    Works on any module whose ``forward`` returns ``(logits1, logits2)``. Each strategy runs on
    its own ``copy.deepcopy`` of ``model`` (gradients cleared), in the model's current train/eval
    mode, so the caller's parameters, buffers, ``.grad`` and global RNG state are untouched.
    Dropout draws its masks from one random stream seeded with ``seed`` (concat first, then
    separate), as two training runs would: the masks differ between the strategies.

    Equal up to rounding when no layer couples samples (no train-mode BatchNorm, no dropout
    with p > 0 in train mode); in float64 the gradients then agree to ~1e-16 per entry.

    Args:
        model: the two-head model (not modified).
        x_sup: labeled batch ``(N_sup, ...)``; y_sup: its labels ``(N_sup,)`` in ``[0, K)``.
        x_unsup: unlabeled batch ``(N_unsup, ...)``, same trailing shape as ``x_sup``.
        margin: the discrepancy loss's margin m (nats), as in :func:`~mcd_helpers.train.step_b_loss`.
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
    model_dtype, device = _model_dtype_device(model)
    dtype = dtype or model_dtype
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype such as torch.float64, got {dtype}.")
    x_sup, x_unsup = x_sup.to(device, dtype), x_unsup.to(device, dtype)
    y_sup = y_sup.to(device)
    buffers_before = _buffers(model)

    results = {}
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for strategy in ("concat", "separate"):
            m = copy.deepcopy(model).to(dtype)
            for p in m.parameters():
                p.grad = None
            try:
                loss, parts = step_b_loss(m, x_sup, y_sup, x_unsup, strategy, margin)
            except (TypeError, ValueError) as err:
                if "unpack" not in str(err):
                    raise
                raise TypeError("the model's forward must return two tensors (logits1, logits2), each "
                                f"(N, K); unpacking its output failed: {err}") from err
            loss.backward()
            grads = {name: p.grad for name, p in m.named_parameters()}
            results[strategy] = (loss.item(), {k: float(v) for k, v in parts.items()}, grads, _buffers(m))

    (loss_c, parts_c, grads_c, bufs_c), (loss_s, parts_s, grads_s, bufs_s) = results["concat"], results["separate"]
    grad_diff = {name: _max_abs_diff(grads_c[name], grads_s[name]) for name in grads_c}
    buffer_diff = {name: _max_abs_diff(bufs_c[name], bufs_s[name]) for name in bufs_c}
    grad_scale = max((float(g.abs().max()) for g in grads_c.values() if g is not None and g.numel()), default=0.0)
    return StrategyComparison(
        loss_concat=loss_c, loss_separate=loss_s, max_grad_diff=max(grad_diff.values(), default=0.0),
        grad_diff=grad_diff, buffer_diff=buffer_diff, grad_scale=grad_scale,
        parts_concat=parts_c, parts_separate=parts_s, training=model.training, dtype=dtype,
        n_sup=len(x_sup), n_unsup=len(x_unsup), tolerance=default_tolerance(dtype),
        buffers_before=buffers_before, buffers_concat=bufs_c, buffers_separate=bufs_s)


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
    dtype, device = _model_dtype_device(m)
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
    dtype, device = _model_dtype_device(m)
    x_sup, x_unsup, y_sup = x_sup.to(device, dtype), x_unsup.to(device, dtype), y_sup.to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
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
            loss, _ = step_b_loss(m, x_sup, y_sup, x_unsup, strategy, margin)
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
