"""BatchNorm's coupling and its fixes: per-source running statistics, recalibration, eval-mode
statistics.

With separate forwards of a labeled and an unlabeled batch, train-mode BatchNorm normalises each
batch with its own statistics, but its *running* statistics (used at evaluation) average both
streams. Three fixes from practice (notebooks 08 and 09):

* :func:`per_source_batchnorm` -- one set of running statistics per source (:func:`use_source`
  picks it), the affine weight and bias shared; evaluation uses source 0. The idea of AdvProp's
  auxiliary BatchNorm (Xie et al., CVPR 2020, arXiv 1911.09665) and of domain-specific BatchNorm
  (Chang et al., CVPR 2019, arXiv 1906.03950).
* :func:`recalibrate_bn` -- after training, recompute the running statistics on ID data alone
  (an equal-weight average over batches, as ``torch.optim.swa_utils.update_bn``).
* :func:`eval_mode_bn` -- BatchNorm in eval mode during training: no sample is coupled to another.

And one probe of the coupling itself, for the mechanism study (docs/near-ood.md):

* :func:`detached_stats_batchnorm` -- train-mode BatchNorm whose batch mean and variance carry no
  gradient: the forward and the running statistics as ``nn.BatchNorm``'s, the backward as if the
  statistics were constants.
"""

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class PerSourceBatchNorm(nn.Module):
    """BatchNorm with running statistics per source and one shared affine transform.

    Train mode normalises with the batch's statistics (as ``nn.BatchNorm*d``) and updates only the
    current ``source``'s running statistics; eval mode normalises with the current source's.

    Shapes:
        x: ``(N, C)`` or ``(N, C, *)`` -> same shape. Buffers ``running_mean``, ``running_var``:
        ``(num_sources, C)``; ``num_batches_tracked``: ``(num_sources,)``.
    """

    def __init__(
        self,
        num_features: int,
        num_sources: int = 2,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
    ):
        super().__init__()
        if num_sources < 1:
            raise ValueError(f"num_sources must be >= 1, got {num_sources}.")
        self.num_features, self.num_sources, self.eps, self.momentum = (
            num_features,
            num_sources,
            eps,
            momentum,
        )
        self.weight, self.bias = (
            nn.Parameter(torch.ones(num_features)),
            nn.Parameter(torch.zeros(num_features)),
        )
        self.register_buffer("running_mean", torch.zeros(num_sources, num_features))
        self.register_buffer("running_var", torch.ones(num_sources, num_features))
        self.register_buffer("num_batches_tracked", torch.zeros(num_sources, dtype=torch.long))
        self.source = 0

    @classmethod
    def from_batchnorm(cls, bn: nn.Module, num_sources: int = 2) -> "PerSourceBatchNorm":
        """A copy of ``bn`` whose every source starts from ``bn``'s statistics.

        Raises:
            ValueError: if ``bn`` has no affine parameters or keeps no running statistics.
        """
        if not bn.affine or not bn.track_running_stats:
            raise ValueError(
                f"{bn} cannot get per-source statistics: needs affine=True and "
                "track_running_stats=True."
            )
        new = cls(bn.num_features, num_sources, bn.eps, bn.momentum).to(
            bn.weight.device, bn.weight.dtype
        )
        # weight, bias (C,) shared; running_mean, running_var (C,) and num_batches_tracked () copied
        # to a row per source
        new.load_state_dict(
            {
                k: v if k in ("weight", "bias") else v.expand(num_sources, *v.shape)
                for k, v in bn.state_dict().items()
            }
        )
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # momentum=None: a cumulative average, as nn.BatchNorm's (unused in eval mode)
        s = self.source
        momentum = (
            1.0 / float(self.num_batches_tracked[s] + 1) if self.momentum is None else self.momentum
        )
        # F.batch_norm updates the running statistics it is given in place: this source's rows
        out = F.batch_norm(
            x,
            self.running_mean[s],
            self.running_var[s],
            self.weight,
            self.bias,
            self.training,
            momentum,
            self.eps,
        )
        if self.training:
            self.num_batches_tracked[s] += 1  # counted once the forward has succeeded
        return out


def per_source_batchnorm(model: nn.Module, num_sources: int = 2) -> nn.Module:
    """A deep copy of ``model`` with every ``BatchNorm{1,2,3}d`` replaced by
    :class:`PerSourceBatchNorm` (a bare BatchNorm layer: :meth:`PerSourceBatchNorm.from_batchnorm`).

    Raises:
        ValueError: if the model has no BatchNorm layer.
    """
    model = copy.deepcopy(model)
    if not (
        found := [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if isinstance(child, _BN)
        ]
    ):
        raise ValueError("the model has no BatchNorm layer to give per-source statistics.")
    for parent, name, child in found:
        setattr(parent, name, PerSourceBatchNorm.from_batchnorm(child, num_sources))
    return model


def has_sources(model: nn.Module) -> bool:
    """Whether ``model`` holds :class:`PerSourceBatchNorm` layers."""
    return any(isinstance(m, PerSourceBatchNorm) for m in model.modules())


@contextlib.contextmanager
def use_source(model: nn.Module, source: int):
    """Within the block every :class:`PerSourceBatchNorm` of ``model`` uses (and in train mode
    updates) the statistics of ``source``; afterwards each goes back to its previous source. Without
    such a layer (plain BatchNorm, no BatchNorm) there is nothing to switch: a no-op.

    Raises:
        ValueError: if ``source`` is out of range of a layer's sources.
    """
    layers = [m for m in model.modules() if isinstance(m, PerSourceBatchNorm)]
    if not all(0 <= source < m.num_sources for m in layers):
        raise ValueError(
            f"source must be in [0, {min(m.num_sources for m in layers)}), got {source}."
        )
    before = [m.source for m in layers]
    try:
        for m in layers:
            m.source = source
        yield model
    finally:
        for m, s in zip(layers, before):
            m.source = s


@torch.no_grad()
def recalibrate_bn(model: nn.Module, x: torch.Tensor, batch_size: int = 256) -> nn.Module:
    """Recompute every BatchNorm's running statistics from ``x`` alone, in place; returns ``model``.

    The statistics are reset and re-estimated as the equal-weight average over the batches of
    ``x`` (``momentum=None``, as ``torch.optim.swa_utils.update_bn``): the mean of the batch means
    and of the unbiased batch variances; a last batch of one sample is skipped. Parameters, modes
    and momenta are kept (layers in eval mode stay so, recalibrated too); on an error the old
    statistics come back. Source 0 of a :class:`PerSourceBatchNorm` is the one recalibrated.

    Shapes:
        x: ``(N, ...)``, the model's input (e.g. ID training images), on the model's device.

    Raises:
        ValueError: no BatchNorm layer with running statistics, fewer than 2 samples,
        ``batch_size < 2``.
    """
    if not (
        layers := [
            m
            for m in model.modules()
            if isinstance(m, (*_BN, PerSourceBatchNorm))
            and getattr(m, "running_mean", None) is not None
        ]
    ):
        raise ValueError(
            "recalibrate_bn: the model has no BatchNorm layer with running statistics."
        )
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or len(x) < 2:
        raise ValueError("recalibrate_bn needs a batch tensor x (N, ...) with N >= 2 samples.")
    if not isinstance(batch_size, int) or batch_size < 2:
        raise ValueError(
            "batch_size must be an integer >= 2 (a variance needs two samples), got "
            f"{batch_size!r}."
        )
    modes, momenta = {m: m.training for m in model.modules()}, [m.momentum for m in layers]
    saved = [copy.deepcopy(m.state_dict()) for m in layers]
    try:
        for m in layers:
            # source 0's statistics, or all of the layer's
            row = 0 if isinstance(m, PerSourceBatchNorm) else ...
            m.momentum, m.running_mean[row], m.running_var[row], m.num_batches_tracked[row] = (
                None,
                0.0,
                1.0,
                0,
            )
        model.train()
        with use_source(model, 0):
            for chunk in [c for c in x.split(batch_size) if len(c) > 1]:
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


def eval_mode_bn(model: nn.Module) -> nn.Module:
    """Put every BatchNorm of ``model`` in eval mode, in place (call it after ``model.train()``).

    Layers in eval mode normalise with their running statistics and never update them, so concat
    equals separate; their weight and bias still learn. Raises ``ValueError`` without BatchNorm.
    """
    if not (layers := [m for m in model.modules() if isinstance(m, (*_BN, PerSourceBatchNorm))]):
        raise ValueError("eval_mode_bn: the model has no BatchNorm layer.")
    for m in layers:
        m.eval()
    return model


class DetachedStatsBatchNorm(nn.BatchNorm2d):
    """Train-mode BatchNorm without a gradient through its batch statistics.

    The forward normalises with the batch's mean and biased variance over every axis but the
    channel one and updates the running statistics (unbiased variance, ``momentum``; ``None``: a
    cumulative average), exactly as ``nn.BatchNorm*d`` does; the backward treats the mean and the
    variance as constants, so ``dy/dx = weight / sqrt(var + eps)`` per channel and no sample's
    gradient reaches another through the statistics. Eval mode is ``nn.BatchNorm``'s. A subclass of
    ``nn.BatchNorm2d`` that accepts any input ``(N, C, *)``, so that :func:`recalibrate_bn` and
    :func:`eval_mode_bn` treat it as BatchNorm.

    Shapes: x ``(N, C)`` or ``(N, C, *)`` -> the same shape.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input (N, C, *), got shape {tuple(x.shape)}.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        # the statistics in float32 at least (as BatchNorm does under autocast)
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        var, mean = torch.var_mean(xs, dims, correction=0)
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            self.num_batches_tracked += 1
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
            else:
                momentum = self.momentum
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
            unbiased = var * n / max(n - 1, 1)
            self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        # eval-mode batch_norm with the batch's statistics, detached: normalised as in train mode
        return F.batch_norm(
            x, mean.detach(), var.detach(), self.weight, self.bias, False, 0.0, self.eps
        )


def detached_stats_batchnorm(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every ``BatchNorm{1,2,3}d`` replaced by
    :class:`DetachedStatsBatchNorm` holding its parameters and statistics (the state dict keeps its
    keys).

    Raises:
        ValueError: if the model has no BatchNorm layer, or one without affine parameters or
        running statistics.
    """
    model = copy.deepcopy(model)
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, _BN) and not isinstance(child, DetachedStatsBatchNorm)
    ]
    if not found:
        raise ValueError("the model has no BatchNorm layer whose statistics could be detached.")
    for parent, name, child in found:
        if not child.affine or not child.track_running_stats:
            raise ValueError(
                f"{child} cannot have its statistics detached: needs affine=True and "
                "track_running_stats=True."
            )
        new = DetachedStatsBatchNorm(child.num_features, child.eps, child.momentum).to(
            child.weight.device, child.weight.dtype
        )
        new.load_state_dict(child.state_dict())
        new.train(child.training)
        setattr(parent, name, new)
    return model
