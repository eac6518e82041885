"""Peak memory of the backward schedules of one Step B: concat, sum-then-backward, per-part backward.

What is measured, on any device: the bytes of the tensors autograd **saves for backward** (the
activations) that are alive at the same time, counted through
``torch.autograd.graph.saved_tensors_hooks``. Every saved tensor is packed into a small object that
adds its bytes when the graph saves it and subtracts them when autograd frees it (after the
backward that used it, or when the graph is dropped). Each distinct tensor counts once (a tensor
saved by two nodes, e.g. a ReLU output that the next layer also saves, is one allocation), and
tensors that live whatever the schedule (the parameters and their views, the caller's input
batches) are not counted. BatchNorm's running buffers (``running_mean``, ``running_var``) are
saved by its backward node too and *are* counted, once per layer whatever the schedule (two
``(C,)`` vectors per layer, tiny next to the activations). This is the part of a training
step's memory that grows with the batch and that the schedules change; it leaves out gradient
buffers, the optimizer state and allocator caching (on CUDA, ``torch.cuda.max_memory_allocated``
measures all of those together).

Schedules (each ends with ``.grad`` holding the gradient of CE1 + CE2 + discrepancy loss):

* ``"concat"``: one forward of ``cat([x_sup, x_unsup])``, rows split, summed loss, one backward.
* ``"sum"``: two forwards, then ``(loss_sup + loss_unsup).backward()``: both graphs alive at once.
* ``"per_part_late"``: two forwards, then ``loss_sup.backward()``, ``loss_unsup.backward()``:
  the first graph is freed early, but only after both forwards built their graphs.
* ``"per_part"``: forward and backward of the labeled part, then of the unlabeled part (gradient
  accumulation over two micro-batches): only one part's graph is alive at any time.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..losses import discrepancy_loss, supervised_loss

SCHEDULES = ("concat", "sum", "per_part_late", "per_part")


class _Packed:
    """A saved tensor with a receipt: its bytes are released from the meter when autograd drops it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, meter: "SavedTensorMeter", tensor: torch.Tensor, key: tuple):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class SavedTensorMeter:
    """Context manager: live and peak bytes of the tensors autograd saves for backward inside it.

    ``exclude``: tensors whose storage is not counted (parameters, inputs that exist anyway).
    Attributes ``live_bytes`` and ``peak_bytes`` (bytes, int). Tensors saved inside the context
    stay accounted until autograd frees them, also after the context has exited.

    Raises:
        TypeError: if ``exclude`` holds anything but tensors (e.g. pass ``model.parameters()``,
            not the model).
    """

    def __init__(self, exclude=()):
        exclude = list(exclude)
        for i, t in enumerate(exclude):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"exclude must hold tensors (parameters, input batches); item {i} is a "
                                f"{type(t).__name__}.")
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[tuple, int] = {}
        self._bytes: dict[tuple, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage().data_ptr()
        if storage in self._excluded or t.numel() == 0:
            return t
        key = (storage, t.storage_offset(), t.numel(), t.dtype)
        if self._refs.get(key, 0) == 0:
            self._bytes[key] = t.numel() * t.element_size()
            self.live_bytes += self._bytes[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = self._refs.get(key, 0) + 1
        # detach: keep the memory, not the grad_fn (a saved output holding its own grad_fn is a cycle)
        return _Packed(self, t.detach(), key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live_bytes -= self._bytes.pop(key)
            del self._refs[key]

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@dataclass
class ScheduleMemory:
    """Result of :func:`schedule_memory`.

    ``peak_bytes``: peak bytes of saved activations alive at once (see the module docstring);
    ``live_after_bytes``: saved bytes still alive after the schedule (0 when every graph was freed);
    ``grads``: parameter name -> ``.grad`` after the schedule; ``loss``: CE1 + CE2 + discrepancy (nats).
    """
    schedule: str
    peak_bytes: int
    live_after_bytes: int
    loss: float
    grads: dict[str, torch.Tensor] = field(repr=False)


def schedule_memory(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor,
                    schedule: str, margin: float = 1.2) -> ScheduleMemory:
    """Run one Step B backward ``schedule`` on a deep copy of ``model`` and measure saved-activation memory.

    The model's forward must return ``(logits1, logits2)``. No optimizer step is taken; the
    caller's model is not touched. Inputs are moved to the model's device and dtype.

    Shapes:
        x_sup: ``(N_sup, ...)``, y_sup: ``(N_sup,)``, x_unsup: ``(N_unsup, ...)``.

    Raises:
        ValueError: on an unknown schedule, inputs that differ in anything but the batch size, a
            model without parameters or with none that requires a gradient (a frozen model).
        TypeError: if an input is not a tensor, or the model's forward does not return two tensors.
        RuntimeError: if called with autograd disabled (inside ``torch.no_grad()`` or
            ``torch.inference_mode()``): no graph would be built.
        Errors of :func:`~mcd_helpers.losses.supervised_loss` and
        :func:`~mcd_helpers.losses.discrepancy_loss` on bad labels, batches or margin.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
    for name, t in (("x_sup", x_sup), ("y_sup", y_sup), ("x_unsup", x_unsup)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__} "
                            f"(convert it with torch.as_tensor).")
    if x_sup.shape[1:] != x_unsup.shape[1:]:
        raise ValueError(f"x_sup and x_unsup must agree except in the batch size, got {tuple(x_sup.shape)} "
                         f"and {tuple(x_unsup.shape)}.")
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise RuntimeError("schedule_memory measures the graphs autograd builds, but autograd is disabled here "
                           "(inside torch.no_grad() or torch.inference_mode()): call it outside that block.")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"model ({type(model).__name__}) has no parameters: there is no backward to measure.")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"no parameter of the model ({type(model).__name__}) requires a gradient (a frozen "
                         "model): call model.requires_grad_(True) on the part Step B trains.")
    m = copy.deepcopy(model)
    p0 = next(m.parameters())
    x_sup, x_unsup = x_sup.to(p0.device, p0.dtype), x_unsup.to(p0.device, p0.dtype)
    y_sup = y_sup.to(p0.device)
    m.zero_grad(set_to_none=True)
    meter = SavedTensorMeter(exclude=[*m.parameters(), x_sup, x_unsup])

    def forward(x):
        out = m(x)
        two_tensors = isinstance(out, (tuple, list)) and len(out) == 2
        if not (two_tensors and all(isinstance(o, torch.Tensor) for o in out)):
            if isinstance(out, torch.Tensor):
                got = f"a tensor of shape {tuple(out.shape)}"
            else:
                got = f"a {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
            raise TypeError(f"the model's forward must return (logits1, logits2), the outputs of F1 and F2, "
                            f"each (N, K); it returned {got}. Use a two-head model (mcd_helpers.TwoHeadNet).")
        return out

    def sup_loss():
        return supervised_loss(*forward(x_sup), y_sup)

    def unsup_loss():
        return discrepancy_loss(*forward(x_unsup), margin=margin)

    with meter:
        if schedule == "concat":
            n = x_sup.shape[0]
            out1, out2 = forward(torch.cat([x_sup, x_unsup]))  # (N_sup + N_unsup, K) each
            loss = supervised_loss(out1[:n], out2[:n], y_sup) + discrepancy_loss(out1[n:], out2[n:], margin)
            del out1, out2
            loss.backward()
            total = loss.item()
        elif schedule == "sum":
            loss = sup_loss() + unsup_loss()
            loss.backward()
            total = loss.item()
        elif schedule == "per_part_late":
            loss_sup, loss_unsup = sup_loss(), unsup_loss()
            loss_sup.backward()  # frees the labeled graph; the unlabeled one was built already
            loss_unsup.backward()
            total = loss_sup.item() + loss_unsup.item()
        else:  # per_part: gradient accumulation over the two parts
            loss_sup = sup_loss()
            loss_sup.backward()  # the labeled graph is freed before the unlabeled forward
            loss_unsup = unsup_loss()
            loss_unsup.backward()
            total = loss_sup.item() + loss_unsup.item()
    grads = {name: p.grad.detach().clone() for name, p in m.named_parameters() if p.grad is not None}
    return ScheduleMemory(schedule, meter.peak_bytes, meter.live_bytes, total, grads)
