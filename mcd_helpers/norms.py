"""BatchNorm coupling and its fixes: per-source statistics, recalibration, frozen statistics.

With separate forwards of a labeled and an unlabeled batch, train-mode BatchNorm normalises each
batch with its own statistics (no mixing inside a forward), but its *running* statistics, used at
evaluation, are a moving average over both streams. Three fixes from practice:

* :class:`PerSourceBatchNorm` / :func:`per_source_batchnorm` -- one set of running statistics per
  source (stream), selected with :func:`use_source`; the affine weight and bias stay shared.
  Evaluation uses source 0 (the labeled ID stream). The idea of AdvProp's auxiliary BatchNorm
  (Xie et al., CVPR 2020, arXiv 1911.09665) and of domain-specific BatchNorm (Chang et al.,
  CVPR 2019, arXiv 1906.03950), here with shared affine parameters.
* :func:`recalibrate_bn` -- after training, recompute the running statistics on ID data alone
  (a cumulative average over the batches, ``momentum=None``), as SWA's ``update_bn`` does.
* :func:`freeze_bn` -- BatchNorm in eval mode during training: normalise with the (pre-trained)
  running statistics, which no forward updates, while the affine parameters still learn.

``GroupNorm``/``LayerNorm`` (per-sample statistics) and ``track_running_stats=False`` need no
helper: see notebook 08.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PerSourceBatchNorm", "per_source_batchnorm", "use_source", "recalibrate_bn", "freeze_bn",
           "batchnorm_layers"]

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def batchnorm_layers(model: nn.Module) -> list[nn.Module]:
    """Every ``BatchNorm{1,2,3}d`` and :class:`PerSourceBatchNorm` of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (*_BN, PerSourceBatchNorm))]


class PerSourceBatchNorm(nn.Module):
    """BatchNorm with one set of running statistics per source and one shared affine transform.

    In train mode it normalises with the batch's statistics, as ``nn.BatchNorm*d`` does, and
    updates only the running statistics of the current ``source``; in eval mode it normalises
    with the current source's running statistics (source 0 unless :func:`use_source` says
    otherwise).

    Shapes:
        x: ``(N, C)`` or ``(N, C, *)`` -> same shape.

    Buffers:
        running_mean, running_var: ``(num_sources, C)``; num_batches_tracked: ``(num_sources,)``.

    Raises:
        ValueError: if ``num_sources < 1``, or ``source`` is set outside ``[0, num_sources)``.
    """

    def __init__(self, num_features: int, num_sources: int = 2, eps: float = 1e-5, momentum: float | None = 0.1):
        super().__init__()
        if num_sources < 1:
            raise ValueError(f"num_sources must be >= 1, got {num_sources}.")
        self.num_features, self.num_sources, self.eps, self.momentum = num_features, num_sources, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_sources, num_features))
        self.register_buffer("running_var", torch.ones(num_sources, num_features))
        self.register_buffer("num_batches_tracked", torch.zeros(num_sources, dtype=torch.long))
        self._source = 0

    @property
    def source(self) -> int:
        return self._source

    @source.setter
    def source(self, value: int) -> None:
        if not 0 <= int(value) < self.num_sources:
            raise ValueError(f"source must be in [0, {self.num_sources}), got {value}.")
        self._source = int(value)

    @classmethod
    def from_batchnorm(cls, bn: nn.Module, num_sources: int = 2) -> "PerSourceBatchNorm":
        """A copy of ``bn`` whose every source starts from ``bn``'s running statistics.

        Raises:
            ValueError: if ``bn`` has no affine parameters or does not track running statistics
                (there would be nothing per source to keep).
        """
        if not bn.affine or not bn.track_running_stats:
            raise ValueError(f"{bn} cannot get per-source statistics: it needs affine=True and "
                             "track_running_stats=True (without running statistics there is nothing per source).")
        new = cls(bn.num_features, num_sources, bn.eps, bn.momentum).to(bn.weight.device, bn.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(bn.weight)
            new.bias.copy_(bn.bias)
            if bn.running_mean is not None:
                new.running_mean.copy_(bn.running_mean.expand(num_sources, -1))
                new.running_var.copy_(bn.running_var.expand(num_sources, -1))
                new.num_batches_tracked.fill_(int(bn.num_batches_tracked))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self._source
        momentum = self.momentum
        if self.training and momentum is None:  # cumulative moving average, as nn.BatchNorm with momentum=None
            momentum = 1.0 / float(self.num_batches_tracked[s] + 1)
        # F.batch_norm updates the running statistics it is given in place: pass this source's rows.
        out = F.batch_norm(x, self.running_mean[s], self.running_var[s], self.weight, self.bias,
                           self.training, momentum or 0.0, self.eps)
        if self.training:
            self.num_batches_tracked[s] += 1  # counted once the forward has succeeded
        return out

    def extra_repr(self) -> str:
        return f"{self.num_features}, num_sources={self.num_sources}, eps={self.eps}, momentum={self.momentum}"


def per_source_batchnorm(model: nn.Module, num_sources: int = 2) -> nn.Module:
    """A deep copy of ``model`` with every ``BatchNorm{1,2,3}d`` replaced by :class:`PerSourceBatchNorm`.

    Raises:
        ValueError: if the model has no BatchNorm layer, or on ``num_sources < 1``.
    """
    model = copy.deepcopy(model)
    found = False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BN):
                setattr(parent, name, PerSourceBatchNorm.from_batchnorm(child, num_sources))
                found = True
    if not found:
        raise ValueError("the model has no BatchNorm layer to give per-source statistics.")
    return model


@contextlib.contextmanager
def use_source(model: nn.Module, source: int) -> Iterator[nn.Module]:
    """Within the block, every :class:`PerSourceBatchNorm` of ``model`` uses (and in train mode
    updates) the running statistics of ``source``; afterwards each goes back to its previous source.

    Raises:
        ValueError: if ``model`` has no :class:`PerSourceBatchNorm`, or ``source`` is out of range.
    """
    layers = [m for m in model.modules() if isinstance(m, PerSourceBatchNorm)]
    if not layers:
        raise ValueError("use_source needs a model with PerSourceBatchNorm layers: convert it with "
                         "per_source_batchnorm(model) first.")
    before = [m.source for m in layers]
    try:
        for m in layers:
            m.source = source
        yield model
    finally:
        for m, s in zip(layers, before):
            m._source = s


@torch.no_grad()
def recalibrate_bn(model: nn.Module, x: torch.Tensor, batch_size: int = 256) -> nn.Module:
    """Recompute every BatchNorm's running statistics from ``x`` alone (in place; returns ``model``).

    The running statistics are reset and re-estimated as the equal-weight average over the
    batches of ``x`` (``momentum=None``, as ``torch.optim.swa_utils.update_bn`` does): the mean
    of the batch means, and of the unbiased batch variances. Parameters are not changed; every
    module's train/eval mode and each layer's momentum are restored (frozen layers stay frozen,
    and are recalibrated too); on an error the old statistics come back. As in ``update_bn``,
    the forwards run in train mode, so dropout is active. Source 0 of a
    :class:`PerSourceBatchNorm` is the one recalibrated.

    Shapes:
        x: ``(N, ...)``, the model's input (e.g. ID training images), on the model's device.

    Raises:
        ValueError: if the model has no BatchNorm layer with running statistics, ``x`` is empty,
            or ``batch_size < 2`` (a batch of one has no variance).
    """
    layers = [m for m in batchnorm_layers(model) if getattr(m, "running_mean", None) is not None]
    if not layers:
        raise ValueError("recalibrate_bn: the model has no BatchNorm layer with running statistics.")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or len(x) < 2:
        raise ValueError("recalibrate_bn needs a batch tensor x (N, ...) with N >= 2 samples "
                         f"(got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}).")
    if not isinstance(batch_size, int) or batch_size < 2:
        raise ValueError(f"batch_size must be an integer >= 2 (BatchNorm needs two samples for a variance), "
                         f"got {batch_size!r}.")
    modes = {m: m.training for m in model.modules()}
    momenta = [m.momentum for m in layers]
    saved = [copy.deepcopy(m.state_dict()) for m in layers]
    try:
        for m in layers:
            if isinstance(m, PerSourceBatchNorm):
                m.running_mean[0].zero_(), m.running_var[0].fill_(1), m.num_batches_tracked[0].zero_()
            else:
                m.reset_running_stats()
            m.momentum = None
        model.train()
        per_source = any(isinstance(m, PerSourceBatchNorm) for m in layers)
        with use_source(model, 0) if per_source else contextlib.nullcontext():
            for start in range(0, len(x), batch_size):
                chunk = x[start:start + batch_size]
                if len(chunk) > 1:  # a last batch of one sample has no variance: skip it
                    model(chunk)
    except BaseException:
        for m, state in zip(layers, saved):
            m.load_state_dict(state)
        raise
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
        for m, training in modes.items():
            m.training = training
    return model


def freeze_bn(model: nn.Module) -> nn.Module:
    """Put every BatchNorm of ``model`` in eval mode (in place; returns ``model``).

    Frozen layers normalise with their running statistics and never update them, so no sample
    is coupled to another and concat equals separate; their weight and bias still get gradients.
    Call it *after* ``model.train()``, which would switch them back.

    Raises:
        ValueError: if the model has no BatchNorm layer.
    """
    layers = batchnorm_layers(model)
    if not layers:
        raise ValueError("freeze_bn: the model has no BatchNorm layer.")
    for m in layers:
        m.eval()
    return model
