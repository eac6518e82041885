"""What a Step B costs: the activations autograd keeps alive for backward, and the time of a step.

One meter for every schedule and device, :class:`SavedTensorMeter`: the bytes of the tensors
autograd **saves for backward** that are alive at the same time, counted through
``torch.autograd.graph.saved_tensors_hooks``. A saved tensor adds its bytes when the graph saves it
and subtracts them when autograd frees it; a tensor saved by two nodes counts once; tensors that
live whatever the schedule (parameters, the input batches) are excluded. BatchNorm's
``running_mean`` and ``running_var`` are saved by its backward node and counted (tiny next to the
activations). This is the part of a step's memory that grows with the batch; gradients, optimizer
state and the allocator's cache are not in it.

Backward schedules of Step B (:data:`BACKWARD_SCHEDULES`), each leaving the gradient of
CE1 + CE2 + discrepancy loss in ``.grad``:

* ``"concat"``: one forward of ``cat([x_sup, x_unsup])``, one backward;
* ``"separate"``: two forwards, one backward of the summed loss (both graphs alive at once);
* ``"per_part_late"``: two forwards, then one backward per part (the first graph freed early);
* ``"per_part"``: forward and backward of the labeled part, then of the unlabeled part (gradient
  accumulation): one part's graph alive at a time.
"""

import copy
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .losses import discrepancy_loss, supervised_loss
from .strategies import step_b_loss

BACKWARD_SCHEDULES = ("concat", "separate", "per_part_late", "per_part")


class _Packed:
    """A saved tensor whose bytes leave the meter when autograd drops it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, meter: "SavedTensorMeter", tensor: torch.Tensor, key: tuple):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):  # the last saved reference gone: the bytes leave the meter
        refs = self.meter._refs
        refs[self.key] -= 1
        if not refs[self.key]:
            self.meter.live_bytes -= self.key[2]
            del refs[self.key]


class SavedTensorMeter(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: ``live_bytes`` and ``peak_bytes`` of the tensors autograd saves inside it.

    ``exclude``: tensors whose memory is not counted (parameters, inputs that exist anyway). What
    was saved inside the context is accounted until autograd frees it, also after the context exits.

    Raises:
        TypeError: if ``exclude`` holds anything but tensors (pass ``model.parameters()``, not the
        model).
    """

    def __init__(self, exclude=()):
        exclude = list(exclude)
        if not all(isinstance(t, torch.Tensor) for t in exclude):
            raise TypeError(
                "exclude must hold tensors (parameters, input batches), e.g. "
                "[*model.parameters(), x]."
            )
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        # (storage, offset, bytes, dtype) of the viewed memory -> saved references
        self._refs: dict[tuple, int] = {}
        self.live_bytes = self.peak_bytes = 0
        super().__init__(self._pack, lambda p: getattr(p, "tensor", p))

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage().data_ptr()
        if storage in self._excluded or t.numel() == 0:
            return t
        # the memory viewed, not the storage
        key = (storage, t.storage_offset(), t.numel() * t.element_size(), t.dtype)
        if not self._refs.get(key):
            self.live_bytes += key[2]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        # detached: a saved output holding its grad_fn would be a cycle
        return _Packed(self, t.detach(), key)

    def __enter__(self) -> "SavedTensorMeter":
        super().__enter__()
        return self


@dataclass
class StepCost:
    """Result of :func:`step_cost`: ``peak_bytes`` and ``live_after_bytes`` (saved activations,
    bytes), ``loss`` (nats), ``grads`` (name -> ``.grad``), ``ms_per_step`` (median, None when not
    timed)."""

    schedule: str
    peak_bytes: int
    live_after_bytes: int
    loss: float
    ms_per_step: float | None
    device: str
    grads: dict = field(repr=False)


def _heads(out):
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out
    raise TypeError(
        "the model must return (logits1, logits2), the outputs of F1 and F2; got "
        f"{type(out).__name__}."
    )


def _backward(loss: torch.Tensor) -> float:
    loss.backward()
    return loss.item()


def _run(m: nn.Module, x_sup, y_sup, x_unsup, schedule: str, margin: float) -> float:
    """One Step B by ``schedule``, its gradient accumulated into ``.grad``; returns its loss (nats).
    ``per_part`` frees the labeled graph before the unlabeled forward, ``per_part_late`` builds both
    graphs, then frees them."""
    if schedule in ("concat", "separate"):
        return _backward(step_b_loss(m, x_sup, y_sup, x_unsup, schedule, margin)[0])
    parts = (
        lambda: supervised_loss(*_heads(m(x_sup)), y_sup),
        lambda: discrepancy_loss(*_heads(m(x_unsup)), margin),
    )
    losses = (part() for part in parts) if schedule == "per_part" else [part() for part in parts]
    return sum(_backward(loss) for loss in losses)


def _median_ms(m: nn.Module, x_sup, y_sup, x_unsup, schedule: str, margin: float, repeats: int):
    """The median time of ``repeats`` steps of ``schedule`` (each with an SGD step, lr 0.01;
    CUDA-synchronised), in ms; None without repeats."""
    device = next(m.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else torch.cpu.synchronize  # CPU: no-op
    times, opt = [], torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        m.zero_grad(set_to_none=True)
        _run(m, x_sup, y_sup, x_unsup, schedule, margin)
        opt.step()
        sync(device)
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2] if times else None


def step_cost(
    model: nn.Module,
    x_sup: torch.Tensor,
    y_sup: torch.Tensor,
    x_unsup: torch.Tensor,
    schedule: str = "separate",
    repeats: int = 0,
    margin: float = 1.2,
) -> StepCost:
    """Run one Step B ``schedule`` on a deep copy of ``model``: saved-activation memory, loss,
    gradients; with ``repeats >= 1`` also the median time of that many more steps. The caller's
    model is untouched; inputs go to its device and dtype.

    Shapes:
        x_sup: ``(N_sup, ...)``, y_sup: ``(N_sup,)``, x_unsup: ``(N_unsup, ...)``.

    Raises:
        ValueError: an unknown schedule, negative ``repeats``, batches of different shapes, a model
            with no trainable parameter.
        TypeError: inputs that are not tensors, a model that does not return
            ``(logits1, logits2)``.
        RuntimeError: autograd disabled (``torch.no_grad()``).
    """
    if schedule not in BACKWARD_SCHEDULES or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(
            f"schedule must be one of {BACKWARD_SCHEDULES} and repeats an integer >= 0; got "
            f"{schedule!r}, repeats={repeats!r}."
        )
    if not all(isinstance(t, torch.Tensor) for t in (x_sup, y_sup, x_unsup)):
        raise TypeError(
            "x_sup, y_sup and x_unsup must be torch.Tensors (convert them with torch.as_tensor)."
        )
    if x_sup.shape[1:] != x_unsup.shape[1:]:
        raise ValueError(
            f"x_sup {tuple(x_sup.shape)} and x_unsup {tuple(x_unsup.shape)} must agree but "
            "in batch size."
        )
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise RuntimeError(
            "autograd is disabled here (torch.no_grad() or torch.inference_mode()): leave "
            "that block."
        )
    if not any(p.requires_grad for p in model.parameters()):
        name = type(model).__name__
        raise ValueError(f"the model ({name}) has no parameter with requires_grad=True to measure.")
    m = copy.deepcopy(model)
    p = next(m.parameters())
    x_sup, x_unsup, y_sup = (
        x_sup.to(p.device, p.dtype),
        x_unsup.to(p.device, p.dtype),
        y_sup.to(p.device),
    )
    m.zero_grad(set_to_none=True)
    with SavedTensorMeter(exclude=[*m.parameters(), x_sup, x_unsup]) as meter:
        loss = _run(m, x_sup, y_sup, x_unsup, schedule, margin)
    grads = {k: q.grad.detach().clone() for k, q in m.named_parameters() if q.grad is not None}
    ms = _median_ms(m, x_sup, y_sup, x_unsup, schedule, margin, repeats)
    return StepCost(schedule, meter.peak_bytes, meter.live_bytes, loss, ms, str(p.device), grads)
