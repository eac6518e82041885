"""One forward of the concatenation, or one forward per batch? Any number of batches.

:func:`compare_forwards` is the general form of the project's question. Given ``k`` input
batches ``x_1 .. x_k`` (a labeled batch, weak and strong augmentations, several domains ...):

* ``"concat"``: one forward of ``torch.cat([x_1, ..., x_k])``, its output split back by rows;
* ``"separate"``: ``k`` forwards ``model(x_1) .. model(x_k)``;

then the same ``loss_fn(outputs)`` on the list of per-batch outputs and one backward. It reports
the losses, every gradient difference, every buffer difference and how many times BatchNorm
updated its running statistics under each strategy, counted from the buffers themselves (so a
model that updates them twice per forward, such as a gradient-checkpointed segment, shows it).

Equal up to rounding when no layer couples the samples of a batch in the current mode (no
train-mode BatchNorm, no dropout draws); train-mode BatchNorm gives different losses, gradients
and running statistics, and ``k`` running-statistic updates with separate forwards against one
with the concatenation. :func:`mcd_helpers.compare_strategies` is the two-batch MCD case.
"""
from __future__ import annotations

import copy
import html
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["ForwardsComparison", "compare_forwards", "default_tolerance", "forward_outputs", "split_rows"]

_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}


def default_tolerance(dtype: torch.dtype) -> float:
    """Largest difference still called "equal up to rounding" for ``dtype``, relative to the
    size of what is compared (``|Δ| <= tolerance * max(1, scale)``, see ``ForwardsComparison.same``).

    float64: 1e-10 (rounding is ~1e-16 per operation); float32: 1e-4 (rounding ~1e-7 per
    operation, summed over reductions of thousands of terms); half types: 1e-2 / 1e-1 — too
    coarse to tell a small coupling from rounding: compare in float64 for that.
    """
    return _TOLERANCE.get(dtype, 1e-4)


def _max(values) -> float:
    """max of floats, NaN when any is NaN (Python's ``max`` would skip a NaN that is not first)."""
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


@dataclass
class ForwardsComparison:
    """``k`` batches through one model, once concatenated and once forward by forward.

    Attributes:
        loss_concat, loss_separate: ``loss_fn`` of each strategy (the caller's units; nats for
            cross-entropy losses).
        max_grad_diff: max over all parameters and entries of |grad_concat - grad_separate|.
        grad_diff: parameter name -> max |Δ| of its gradient (0.0 if neither strategy gave it one).
        buffer_diff: buffer name -> max |Δ| after the forwards (BatchNorm's ``running_mean``,
            ``running_var``, ``num_batches_tracked``; empty for a model without buffers).
        grad_scale: max |grad| over all parameters (concat), to read ``max_grad_diff`` against.
        training: the model's mode during the comparison; dtype: its floating dtype.
        batch_sizes: ``(N_1, ..., N_k)``; tolerance: the relative |Δ| still called equal (see ``same``).
        no_grad_params: trainable parameters that got no gradient under either strategy (not
            compared: e.g. unused, or cut off by a reentrant checkpoint).
        buffers_before, buffers_concat, buffers_separate: buffer name -> tensor (CPU copies),
            before the step and after each strategy's forwards.
    """
    loss_concat: float
    loss_separate: float
    max_grad_diff: float
    grad_diff: dict[str, float]
    buffer_diff: dict[str, float]
    grad_scale: float
    training: bool
    dtype: torch.dtype
    batch_sizes: tuple[int, ...]
    tolerance: float
    no_grad_params: list[str] = field(default_factory=list)
    buffers_before: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    buffers_concat: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    buffers_separate: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def loss_diff(self) -> float:
        """|loss_concat - loss_separate|."""
        return abs(self.loss_concat - self.loss_separate)

    @property
    def max_buffer_diff(self) -> float:
        """Max |Δ| over all buffers (0.0 when the model has none; NaN when any difference is NaN)."""
        return _max(self.buffer_diff.values())

    @property
    def max_running_stat_diff(self) -> float:
        """Max |Δ| over floating buffers only (running_mean, running_var), 0.0 when there are none."""
        return _max(d for name, d in self.buffer_diff.items() if self.buffers_before[name].is_floating_point())

    @property
    def tracked_increments_by_layer(self) -> dict[str, tuple[int, int]]:
        """BatchNorm layer -> how much one step added to its ``num_batches_tracked``, ``(concat,
        separate)``: what the buffers did, not what the model's code suggests (summed over the
        sources of a :class:`~mcd_helpers.norms.PerSourceBatchNorm`)."""
        out = {}
        for name, before in self.buffers_before.items():
            if name.endswith("num_batches_tracked"):
                layer = name[: -len(".num_batches_tracked")] or "(model)"
                out[layer] = (int((self.buffers_concat[name] - before).sum()),
                              int((self.buffers_separate[name] - before).sum()))
        return out

    @property
    def tracked_increments(self) -> tuple[int, int] | None:
        """Running-statistic updates in one step ``(concat, separate)``, e.g. ``(1, k)`` in train
        mode; the largest over the BatchNorm layers (see ``tracked_increments_by_layer`` when
        layers differ, e.g. a checkpointed segment updating twice); None without such a buffer."""
        per_layer = self.tracked_increments_by_layer
        if not per_layer:
            return None
        return (max(c for c, _ in per_layer.values()), max(s for _, s in per_layer.values()))

    @property
    def same(self) -> bool:
        """True when loss, every gradient and every buffer agree to within ``tolerance`` relative
        to their size: ``|Δloss| <= tol * max(1, |loss|)``, ``max |Δgrad| <= tol * max(1, max |grad|)``,
        ``max |Δbuffer| <= tol * max(1, max |buffer|)``. False when any difference is NaN."""
        checks = ((self.loss_diff, max(abs(self.loss_concat), abs(self.loss_separate))),
                  (self.max_grad_diff, self.grad_scale),
                  (self.max_buffer_diff, self._buffer_scale()))
        return all(d <= self.tolerance * max(1.0, scale) for d, scale in checks)  # NaN <= x is False

    def _buffer_scale(self) -> float:
        return max((float(b.double().abs().max()) for b in self.buffers_concat.values()
                    if b.is_floating_point() and b.numel()), default=0.0)

    @property
    def verdict(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        if self.same:
            return f"same up to {dtype} rounding (all |Δ| <= {self.tolerance:g} relative)"
        if any(math.isnan(d) for d in (self.loss_diff, self.max_grad_diff, self.max_buffer_diff)):
            return "different (a difference is NaN: non-finite losses, gradients or buffers)"
        return f"different (largest |Δ| above the {dtype} tolerance {self.tolerance:g} relative)"

    def top_params(self, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` parameters whose gradients differ most, largest first."""
        return sorted(self.grad_diff.items(), key=lambda kv: -kv[1])[:k]

    def _loss_rows(self) -> list[tuple[str, str, str, str]]:
        return [("loss", f"{self.loss_concat:.10g}", f"{self.loss_separate:.10g}", f"{self.loss_diff:.3g}")]

    def _rows(self, k: int) -> list[tuple[str, str, str, str]]:
        rows = self._loss_rows()
        rows.append(("max |grad| / max |Δgrad|", f"{self.grad_scale:.3g}", "", f"{self.max_grad_diff:.3g}"))
        rows += [(f"grad {name}", "", "", f"{d:.3g}") for name, d in self.top_params(k)]
        per_layer = self.tracked_increments_by_layer
        if len(set(per_layer.values())) > 1:  # layers disagree: show each one
            rows += [(f"{layer} updates per step", f"+{c}", f"+{s}", "") for layer, (c, s) in per_layer.items()]
        elif per_layer:
            c, s = next(iter(per_layer.values()))
            layers = f"{len(per_layer)} BN layer" + ("s" if len(per_layer) > 1 else "")
            rows.append((f"running-stat updates per step ({layers})", f"+{c}", f"+{s}", ""))
        if self.no_grad_params:
            rows.append((f"parameters without a gradient (not compared): {len(self.no_grad_params)}", "", "", ""))
        for name, d in self.buffer_diff.items():
            if not name.endswith("num_batches_tracked") and (d > 0 or len(self.buffer_diff) <= 2 * k):
                rows.append((f"buffer {name}", "", "", f"{d:.3g}"))
        return rows

    def _head(self) -> str:
        mode = "train" if self.training else "eval"
        sizes = " + ".join(str(n) for n in self.batch_sizes)
        return (f"one concatenated forward vs {len(self.batch_sizes)} separate forwards: {mode} mode, "
                f"{str(self.dtype).replace('torch.', '')}, batches {sizes}")

    def __str__(self) -> str:
        rows = [("quantity", "concat", "separate", "|Δ|")] + self._rows(5)
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
        return "\n".join([f"{self._head()} -> {self.verdict}"] + lines)

    def _repr_html_(self) -> str:
        cells = "".join(
            "<tr>" + "".join(f"<td style='text-align:{'left' if i == 0 else 'right'}'>{html.escape(c)}</td>"
                             for i, c in enumerate(r)) + "</tr>" for r in self._rows(8))
        color = "green" if self.same else "firebrick"
        return (f"<p>{html.escape(self._head())}: <b style='color:{color}'>{html.escape(self.verdict)}</b></p>"
                "<table><thead><tr><th>quantity</th><th>concat</th><th>separate</th><th>|Δ|</th></tr>"
                f"</thead><tbody>{cells}</tbody></table>")


def model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The floating dtype and device of the model's first floating parameter or buffer."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype, t.device
    return torch.get_default_dtype(), torch.device("cpu")


def max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| in float64 (a missing tensor counts as zeros; 0.0 for empty tensors)."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        t = a if a is not None else b
        return float(t.detach().abs().max()) if t.numel() else 0.0
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> CPU copy of every buffer of ``model``."""
    return {name: b.detach().cpu().clone() for name, b in model.named_buffers()}


def split_rows(output, sizes: Sequence[int]) -> list:
    """Split a forward's output of the concatenation back into one output per batch.

    ``output`` is a tensor ``(sum(sizes), ...)`` or a tuple/list of such tensors (split each,
    keeping the structure: a two-head model's ``(logits1, logits2)`` gives one
    ``(logits1_i, logits2_i)`` per batch).

    Raises:
        TypeError: if the output is neither a tensor nor a tuple/list of tensors.
        ValueError: if a tensor's first axis is not the total batch size (the model mixes rows,
            e.g. pools over the batch, so its output cannot be split by rows).
    """
    total = sum(sizes)
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != total:
            raise ValueError(f"the model's output {tuple(output.shape)} cannot be split by rows into batches "
                             f"of {tuple(sizes)}: its first axis must be the total batch size {total}. "
                             "compare_forwards needs a model that returns one row per input sample.")
        return list(torch.split(output, list(sizes)))
    if isinstance(output, (tuple, list)):
        if not output:
            raise TypeError("the model returned an empty tuple; it must return a tensor or a tuple of tensors.")
        for i, t in enumerate(output):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"element {i} of the model's output tuple is a {type(t).__name__}, not a tensor; "
                                "the model must return a tensor or a flat tuple of tensors.")
        parts = [split_rows(t, sizes) for t in output]
        return [tuple(p[i] for p in parts) for i in range(len(sizes))]
    raise TypeError(f"the model's output must be a tensor or a tuple of tensors, got {type(output).__name__}.")


def forward_outputs(model: nn.Module, batches: Sequence[torch.Tensor], strategy: str) -> list:
    """The model's output for each batch: ``"concat"`` (one forward of ``torch.cat(batches)``, split
    back by rows) or ``"separate"`` (one forward per batch).

    Shapes:
        batches: ``[(N_1, ...), ..., (N_k, ...)]`` -> ``k`` outputs, output ``i`` with ``N_i`` rows.

    Raises:
        ValueError: on an unknown strategy, or an output that cannot be split by rows.
    """
    if strategy == "concat":
        return split_rows(model(torch.cat(list(batches))), [len(x) for x in batches])  # (sum N_i, ...) split
    if strategy == "separate":
        return [model(x) for x in batches]
    raise ValueError(f"strategy must be 'concat' or 'separate', got {strategy!r}.")


def _check_batches(batches) -> list[torch.Tensor]:
    if isinstance(batches, torch.Tensor) or not isinstance(batches, (list, tuple)):
        raise TypeError("batches must be a list or tuple of input tensors [x_1, ..., x_k], "
                        f"got {type(batches).__name__}.")
    if not batches:
        raise ValueError("compare_forwards needs at least one batch, got an empty list.")
    for i, x in enumerate(batches):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"batch {i} must be a torch.Tensor, got {type(x).__name__}.")
        if x.dim() == 0 or len(x) == 0:
            raise ValueError(f"batch {i} must be a non-empty batch (N, ...), got shape {tuple(x.shape)}.")
    first = batches[0]
    for i, x in enumerate(batches[1:], start=1):
        if x.shape[1:] != first.shape[1:]:
            raise ValueError(f"batch {i} {tuple(x.shape)} and batch 0 {tuple(first.shape)} must agree in every "
                             "axis but the first (batch), or they cannot be concatenated.")
        if x.dtype != first.dtype:
            raise ValueError(f"batch {i} is {x.dtype} but batch 0 is {first.dtype}: give every batch the "
                             "same dtype (torch.cat would silently promote them).")
    return list(batches)


def _scalar(loss, strategy: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (one element), got {shape} with the "
                         f"{strategy} strategy; reduce it, e.g. with .mean() or .sum().")
    return loss.reshape(())


def run_both(model: nn.Module, batches: Sequence[torch.Tensor], loss_fn: Callable, dtype: torch.dtype | None,
             seed: int) -> tuple[dict, torch.dtype, dict[str, torch.Tensor]]:
    """Run ``loss_fn`` on both strategies, each on its own deep copy; returns per-strategy
    ``(loss, grads, buffers)``, the dtype used and the buffers before. See :func:`compare_forwards`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (list of per-batch outputs -> scalar), got {type(loss_fn).__name__}.")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float64, got {dtype!r}.")
    lazy = [name for name, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(f"the model has uninitialised lazy parameters ({', '.join(lazy[:3])}): run one forward "
                         "first, or each copy would initialise its own weights.")
    model_dtype, device = model_dtype_device(model)
    if not any(t.is_floating_point() for t in list(model.parameters()) + list(model.buffers())):
        model_dtype = next((x.dtype for x in batches if x.is_floating_point()), model_dtype)
    dtype = dtype or model_dtype
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype such as torch.float64, got {dtype}.")
    # detached copies: the caller's tensors (and any .grad of theirs) stay untouched
    batches = [x.detach().to(device, dtype) if x.is_floating_point() else x.detach().to(device) for x in batches]
    buffers_before = buffers_of(model)
    results = {}
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for strategy in ("concat", "separate"):
            m = copy.deepcopy(model).to(dtype)
            for p in m.parameters():
                p.grad = None
            outputs = forward_outputs(m, batches, strategy)
            loss = _scalar(loss_fn(outputs), strategy)
            if any(p.requires_grad for p in m.parameters()):
                if loss.grad_fn is None:
                    raise ValueError("loss_fn returned a loss without a gradient path to the parameters (detached, "
                                     "or computed under torch.no_grad): there are no gradients to compare.")
                loss.backward()
            grads = {name: p.grad for name, p in m.named_parameters()}
            results[strategy] = (loss.item(), grads, buffers_of(m))
    return results, dtype, buffers_before


def compare_forwards(model: nn.Module, batches: Sequence[torch.Tensor], loss_fn: Callable[[list], torch.Tensor],
                     dtype: torch.dtype | None = None, seed: int = 0) -> ForwardsComparison:
    """Compute ``loss_fn`` and its gradients with one concatenated forward and with one forward per batch.

    Each strategy runs on its own ``copy.deepcopy`` of ``model`` (gradients cleared), in the
    model's current train/eval mode, so the caller's parameters, buffers, ``.grad`` and global
    RNG state are untouched. Dropout draws its masks from one random stream seeded with ``seed``
    (concat first, then separate), as two training runs would.

    Args:
        model: any module returning one row per input sample: a tensor ``(N, ...)`` or a tuple of
            such tensors (a :class:`~mcd_helpers.models.TwoHeadNet` gives ``(logits1, logits2)``).
        batches: ``[x_1, ..., x_k]``, each ``(N_i, ...)`` with the same trailing shape and dtype.
        loss_fn: ``loss_fn(outputs) -> scalar tensor``; ``outputs[i]`` is the model's output for
            ``x_i`` (split back from the concatenated forward, or from its own forward).
        dtype: run the copies (and floating inputs) in this dtype, e.g. ``torch.float64`` for tight
            checks; default: the model's own dtype. Inputs are moved to the model's device.
        seed: seed of the dropout masks.

    Returns:
        a :class:`ForwardsComparison` (prints as a table; an HTML table in Jupyter).

    Raises:
        TypeError: if ``batches`` is not a list/tuple of tensors, ``loss_fn`` is not callable,
            ``dtype`` is not a ``torch.dtype``, or the model's output is neither a tensor nor a
            flat tuple of tensors.
        ValueError: on no batches, an empty batch, batches of different trailing shapes or dtypes,
            a ``loss_fn`` that returns more than one element or a loss without a gradient path, an
            output that cannot be split by rows, uninitialised lazy parameters, or a non-floating
            ``dtype``.
    """
    batches = _check_batches(batches)
    results, dtype, buffers_before = run_both(model, batches, loss_fn, dtype, seed)
    return _report(ForwardsComparison, results, dtype, buffers_before, model.training, tuple(len(x) for x in batches))


def _report(cls, results: dict, dtype: torch.dtype, buffers_before: dict, training: bool,
            batch_sizes: tuple[int, ...], **extra):
    (loss_c, grads_c, bufs_c), (loss_s, grads_s, bufs_s) = results["concat"], results["separate"]
    grad_diff = {name: max_abs_diff(grads_c[name], grads_s[name]) for name in grads_c}
    no_grad = [name for name in grads_c if grads_c[name] is None and grads_s[name] is None]
    buffer_diff = {name: max_abs_diff(bufs_c[name], bufs_s[name]) for name in bufs_c}
    grad_scale = _max(float(g.detach().abs().max()) for g in grads_c.values() if g is not None and g.numel())
    return cls(loss_concat=loss_c, loss_separate=loss_s, max_grad_diff=_max(grad_diff.values()),
               grad_diff=grad_diff, buffer_diff=buffer_diff, grad_scale=grad_scale, training=training,
               no_grad_params=no_grad,
               dtype=dtype, batch_sizes=batch_sizes, tolerance=default_tolerance(dtype),
               buffers_before=buffers_before, buffers_concat=bufs_c, buffers_separate=bufs_s, **extra)
