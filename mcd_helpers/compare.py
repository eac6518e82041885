"""One forward of the concatenation, or one forward per batch? Measure every difference.

:func:`compare_forwards` is the project's question for any ``k`` batches and any loss: the same
``loss_fn(outputs)`` and one backward after (``"concat"``) one forward of ``torch.cat(batches)``
split back by rows, or (``"separate"``) one forward per batch. The gradient of a sum of losses is
the sum of their gradients (linearity), whatever the shape of the graphs; separate graphs only meet
at the shared parameters' ``AccumulateGrad`` leaves. So the two agree up to rounding exactly when
every layer treats each sample on its own in the current mode: not train-mode BatchNorm, whose batch
statistics couple the samples. Dropout couples nothing; it agrees when its masks do (one random
stream drawn in another order differs). :func:`compare_strategies` is the MCD Step B case.
"""

import copy
import itertools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .losses import step_b_objective
from .strategies import forward_batches
from .tables import markdown_table

# |Δ| still called "equal up to rounding", relative to the size of what is compared: rounding is
# ~1e-16 per float64 operation and ~1e-7 per float32 one, summed over reductions of many terms.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}


def _max(values) -> float:
    """max of floats >= 0, NaN when any is NaN (``max`` would skip a NaN that is not first); 0.0
    when empty."""
    return float(torch.tensor([0.0, *values], dtype=torch.float64).max())


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| in float64; a missing tensor counts as zeros."""
    a, b = (torch.zeros((), dtype=torch.float64) if t is None else t.double() for t in (a, b))
    return float((a - b).abs().max()) if a.numel() and b.numel() else 0.0


@dataclass
class ForwardsComparison:
    """``k`` batches through one model, once concatenated and once forward by forward.

    Attributes:
        loss_concat, loss_separate: ``loss_fn`` of each strategy (nats for cross-entropy losses).
        grad_diff: parameter name -> max |Δ| of its gradient; max_grad_diff: the largest of them.
        grad_scale: max |grad| (concat), to read ``max_grad_diff`` against.
        buffer_diff: buffer name -> max |Δ| after the forwards (BatchNorm's running statistics).
        buffers_before, buffers_concat, buffers_separate: buffer name -> CPU copy.
        training, dtype, batch_sizes: the mode, dtype and ``(N_1, ..., N_k)`` of the comparison.
        tolerance: the relative |Δ| still called equal (:data:`TOLERANCE`, see ``same``).
        no_grad_params: trainable parameters that got no gradient either way (not compared).
    """

    loss_concat: float
    loss_separate: float
    grad_diff: dict[str, float]
    grad_scale: float
    buffer_diff: dict[str, float]
    training: bool
    dtype: torch.dtype
    batch_sizes: tuple[int, ...]
    tolerance: float
    no_grad_params: list[str] = field(default_factory=list)
    buffers_before: dict = field(default_factory=dict, repr=False)
    buffers_concat: dict = field(default_factory=dict, repr=False)
    buffers_separate: dict = field(default_factory=dict, repr=False)

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_concat - self.loss_separate)

    @property
    def max_grad_diff(self) -> float:
        return _max(self.grad_diff.values())

    @property
    def max_running_stat_diff(self) -> float:
        """Max |Δ| over the floating buffers (running_mean, running_var); 0.0 without any."""
        return _max(
            d for k, d in self.buffer_diff.items() if self.buffers_before[k].is_floating_point()
        )

    @property
    def tracked_increments(self) -> tuple[int, int] | None:
        """Running-statistic updates in one step ``(concat, separate)``, read off
        ``num_batches_tracked`` (e.g. ``(1, k)`` in train mode), the largest over the layers; None
        without BatchNorm."""
        inc = [
            (int((self.buffers_concat[k] - b).sum()), int((self.buffers_separate[k] - b).sum()))
            for k, b in self.buffers_before.items()
            if k.endswith("num_batches_tracked")
        ]
        return (max(c for c, _ in inc), max(s for _, s in inc)) if inc else None

    @property
    def same(self) -> bool:
        """Loss, every gradient and every buffer agree within ``tolerance * max(1, size)``; False on
        NaN."""
        scale_buf = max(
            (
                float(b.double().abs().max())
                for b in self.buffers_concat.values()
                if b.is_floating_point() and b.numel()
            ),
            default=0.0,
        )
        checks = (
            (self.loss_diff, max(abs(self.loss_concat), abs(self.loss_separate))),
            (self.max_grad_diff, self.grad_scale),
            (_max(self.buffer_diff.values()), scale_buf),
        )
        return all(d <= self.tolerance * max(1.0, s) for d, s in checks)  # NaN <= x is False

    def _repr_markdown_(self) -> str:
        """The verdict, then a table: loss, max |grad| (concat) and max |Δgrad|, the 5 largest
        gradient differences, the running-statistic updates, the first 6 nonzero buffer differences.
        """
        inc, top = (
            self.tracked_increments,
            sorted(self.grad_diff.items(), key=lambda kv: -kv[1])[:5],
        )
        rows = [
            (
                "loss",
                f"{self.loss_concat:.10g}",
                f"{self.loss_separate:.10g}",
                f"{self.loss_diff:.3g}",
            ),
            ("gradients (max abs)", f"{self.grad_scale:.3g}", "", f"{self.max_grad_diff:.3g}"),
            *[(f"grad {k}", "", "", f"{d:.3g}") for k, d in top],
            *([("running-stat updates per step", f"+{inc[0]}", f"+{inc[1]}", "")] if inc else []),
            *[
                (f"buffer {k}", "", "", f"{d:.3g}")
                for k, d in self.buffer_diff.items()
                if not k.endswith("num_batches_tracked") and d > 0
            ][:6],
            *(
                [
                    (
                        f"parameters without a gradient (not compared): {len(self.no_grad_params)}",
                        "",
                        "",
                        "",
                    )
                ]
                if self.no_grad_params
                else []
            ),
        ]
        return (
            f"concat vs {len(self.batch_sizes)} separate forwards, "
            f"{'train' if self.training else 'eval'} mode, "
            f"batches {' + '.join(map(str, self.batch_sizes))}: "
            f"{f'same up to {str(self.dtype)[6:]} rounding' if self.same else 'DIFFERENT'} "
            f"(relative tolerance {self.tolerance:g})\n\n"
            + markdown_table(("quantity", "concat", "separate", "max abs Δ"), rows, "lrrr")
        )

    __str__ = _repr_markdown_


def comparison_table(comparisons: Mapping[str, ForwardsComparison]) -> str:
    """Several comparisons side by side, a row per label: a Markdown table
    (``display(Markdown(...))``). Raises ``ValueError`` when ``comparisons`` is empty."""
    if not comparisons:
        raise ValueError("comparison_table needs at least one comparison.")
    rows = [
        (
            label,
            "train" if c.training else "eval",
            str(c.dtype)[6:],
            "+".join(map(str, c.batch_sizes)),
            f"{c.loss_diff:.2g}",
            f"{c.max_grad_diff:.2g}",
            f"{c.max_running_stat_diff:.2g}",
            "-" if c.tracked_increments is None else "+%d vs +%d" % c.tracked_increments,
            "same" if c.same else "DIFFERENT",
        )
        for label, c in comparisons.items()
    ]
    return markdown_table(
        (
            "setting",
            "mode",
            "dtype",
            "batch sizes",
            "abs Δloss",
            "max abs Δgrad",
            "max abs Δrunning stats",
            "num_batches_tracked",
            "verdict",
        ),
        rows,
        "llllrrrll",
    )


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: b.detach().cpu().clone() for k, b in model.named_buffers()}


def _checked(model: nn.Module, batches, loss_fn, dtype) -> None:
    """Raise what :func:`compare_forwards` documents for inputs it cannot compare."""
    if not isinstance(batches, (list, tuple)):
        raise TypeError("batches must be a non-empty list of input tensors [x_1, ..., x_k].")
    if not batches:
        raise ValueError("batches must be a non-empty list of input tensors [x_1, ..., x_k].")
    for i, x in enumerate(batches):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"batch {i} must be a torch.Tensor, got {type(x).__name__}.")
        first = batches[0]
        if x.dim() == 0 or len(x) == 0 or x.shape[1:] != first.shape[1:] or x.dtype != first.dtype:
            raise ValueError(
                f"batch {i} {tuple(x.shape)} {x.dtype} does not match batch 0 "
                f"{tuple(first.shape)} {first.dtype}: batches must be non-empty, of one dtype "
                "and of equal shapes but along axis 0."
            )
    if not callable(loss_fn):
        kind = type(loss_fn).__name__
        raise TypeError(f"loss_fn must be callable (outputs -> scalar loss), got {kind}.")
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        raise ValueError("the model has uninitialised lazy parameters: run one forward first.")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise (ValueError if isinstance(dtype, torch.dtype) else TypeError)(
            f"dtype must be a floating torch.dtype such as torch.float64, got {dtype!r}."
        )


def _one_way(model: nn.Module, batches: list, loss_fn, layout: str, dtype) -> tuple:
    """``loss_fn`` of ``layout``'s outputs on a copy of ``model``, and its backward: the loss, the
    copy's parameters (their ``.grad``) and buffers."""
    m = copy.deepcopy(model).to(dtype)
    m.zero_grad(set_to_none=True)
    loss = loss_fn(forward_batches(m, batches, layout))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = getattr(loss, "shape", type(loss))
        raise ValueError(f"loss_fn must return a scalar tensor, got {got}.")
    if any(p.requires_grad for p in m.parameters()):
        if loss.grad_fn is None:
            raise ValueError(
                "loss_fn's loss has no grad_fn: do not detach it or compute it under no_grad()."
            )
        loss.reshape(()).backward()
    return float(loss.detach()), dict(m.named_parameters()), _buffers(m)


def compare_forwards(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    loss_fn: Callable[[list], torch.Tensor],
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> ForwardsComparison:
    """``loss_fn`` and its gradients with one concatenated forward and with one forward per batch.

    Each strategy runs on its own ``copy.deepcopy`` of ``model``, in its current train/eval mode, so
    the caller's parameters, buffers, ``.grad`` and RNG state are untouched. Dropout draws its masks
    from one stream seeded with ``seed`` (concat first), as two training runs would.

    Args:
        model: returns one row per input sample, a tensor ``(N, ...)`` or a tuple of them.
        batches: ``[x_1, ..., x_k]``, each ``(N_i, ...)``, same trailing shape and dtype.
        loss_fn: ``loss_fn(outputs) -> scalar``; ``outputs[i]`` is the output for ``x_i``.
        dtype: run copies and floating inputs in this dtype (``torch.float64`` for tight checks).

    Raises:
        TypeError: batches not a list of tensors, ``loss_fn`` not callable, a ``dtype`` that is
            not one.
        ValueError: no or empty batches, batches that cannot be concatenated, a non-scalar loss or
            one without a gradient path, uninitialised lazy parameters, a non-floating ``dtype``.
    """
    _checked(model, batches, loss_fn, dtype)
    # the first floating parameter or buffer gives the device and the default dtype (none: the
    # CPU, torch's default)
    tensors = [*model.parameters(), *model.buffers()]
    first = next((t for t in tensors if t.is_floating_point()), torch.empty(0))
    device, dtype = first.device, dtype or first.dtype
    batches = [x.detach().to(device, dtype if x.is_floating_point() else x.dtype) for x in batches]
    before = _buffers(model)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        loss_c, params_c, bufs_c = _one_way(model, batches, loss_fn, "concat", dtype)
        loss_s, params_s, bufs_s = _one_way(model, batches, loss_fn, "separate", dtype)
    grads = {k: (params_c[k].grad, params_s[k].grad) for k in params_c}
    return ForwardsComparison(
        loss_concat=loss_c,
        loss_separate=loss_s,
        grad_diff={k: _diff(*g) for k, g in grads.items()},
        grad_scale=_max(
            float(g.abs().max()) for g, _ in grads.values() if g is not None and g.numel()
        ),
        buffer_diff={k: _diff(bufs_c[k], bufs_s[k]) for k in bufs_c},
        training=model.training,
        dtype=dtype,
        batch_sizes=tuple(len(x) for x in batches),
        tolerance=TOLERANCE.get(dtype, 1e-4),
        no_grad_params=[
            k
            for k, (a, b) in grads.items()
            if a is None and b is None and params_c[k].requires_grad
        ],
        buffers_before=before,
        buffers_concat=bufs_c,
        buffers_separate=bufs_s,
    )


def compare_strategies(
    model: nn.Module,
    x_sup: torch.Tensor,
    y_sup: torch.Tensor,
    x_unsup: torch.Tensor,
    margin: float = 1.2,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> ForwardsComparison:
    """One MCD Step B (CE(F1) + CE(F2) on ``x_sup`` + discrepancy loss on ``x_unsup``, nats) both
    ways.

    :func:`compare_forwards` with batches ``[x_sup, x_unsup]`` and the loss of
    :func:`mcd_helpers.strategies.step_b_loss`. In float64 without coupling the gradients agree to
    about 1e-16 per entry (``same`` checks 1e-10 relative).

    Shapes:
        x_sup: ``(N_sup, ...)``, y_sup: ``(N_sup,)`` in ``[0, K)``, x_unsup: ``(N_unsup, ...)``.

    Raises:
        TypeError, ValueError: as :func:`compare_forwards`, and from the losses (labels that do not
            match ``x_sup`` or lie outside ``[0, K)``, a negative margin).
    """
    if not isinstance(y_sup, torch.Tensor):  # x_sup and x_unsup: compare_forwards checks them
        raise TypeError(f"y_sup must be a torch.Tensor of labels, got {type(y_sup).__name__}.")
    y_sup = y_sup.to(next(model.parameters()).device)
    return compare_forwards(
        model, [x_sup, x_unsup], lambda out: step_b_objective(out, y_sup, margin)[0], dtype, seed
    )


def coupling_matrix(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Cross-sample coupling of a batch: ``C[i, j] = ||d out_i / d x_j||_F``.

    ``out_i``: sample i's logits of both heads side by side ``(2K,)``. Per-sample layers give a
    diagonal matrix (exact zeros elsewhere); train-mode BatchNorm fills it. Runs on a deep copy in
    the model's mode, with ``N * 2K`` backward passes: keep ``N`` small.

    Shapes:
        x: ``(N, ...)`` -> ``(N, N)`` float64 on the CPU (row: output sample, column: input sample).
    """
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or len(x) < 1:
        raise ValueError("x must be a batch tensor (N, ...) with N >= 1.")
    p = next(model.parameters())
    x = x.detach().to(p.device, p.dtype).requires_grad_(True)
    # (N, 2K)
    out, sq = (
        torch.cat(copy.deepcopy(model)(x), dim=1),
        torch.zeros(len(x), len(x), dtype=torch.float64),
    )
    for i, k in itertools.product(range(out.shape[0]), range(out.shape[1])):
        (g,) = torch.autograd.grad(out[i, k], x, retain_graph=True)  # (N, ...)
        sq[i] += g.double().flatten(1).pow(2).sum(1).cpu()
    return sq.sqrt()
