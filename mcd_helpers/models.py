"""Two-head networks for MCD: a shared feature extractor G and two linear classifiers F1, F2.

Paper: Q. Yu, K. Aizawa, "Unsupervised Out-of-Distribution Detection by Maximum Classifier
Discrepancy", ICCV 2019 (arXiv 1908.04951), Sec. 3 and Fig. 2. The official code
(github.com/YU1ut/UOOD-MCD, ``models/``) builds G as a DenseNet or WRN without its last linear
layer and F1, F2 as one ``nn.Linear`` each with PyTorch's default initialisation.

Builders (torchvision style, each returns a plain :class:`TwoHeadNet`):

* :func:`small_cnn` -- a CPU-sized 3-conv net for 28x28 Fashion-MNIST, ``norm`` selectable.
* :func:`densenet_bc_100` -- DenseNet-BC, L=100, k=12, CIFAR stem (Huang et al. 2017), 342-d features.
* :func:`wrn_28_10` -- Wide ResNet 28-10, dropout 0 (Zagoruyko & Komodakis 2016), 640-d features.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["TwoHeadNet", "small_cnn", "densenet_bc_100", "wrn_28_10", "build_model", "NORMS"]

NORMS = ("batch", "group", "none")


class TwoHeadNet(nn.Module):
    """Shared feature extractor ``G`` followed by two linear classifiers ``F1`` and ``F2``.

    Args:
        features: the feature extractor G; maps ``(N, C, H, W)`` to ``(N, feature_dim)``.
        feature_dim: width D of G's output.
        num_classes: number of ID classes K.
        in_channels: channel count C that G accepts; checked on every forward.

    Shapes:
        x: ``(N, C, H, W)`` -> ``(logits1, logits2)``, each ``(N, K)``.

    Raises:
        ValueError: if ``x`` is not a 4-D float batch of the model's dtype, its channel count is not ``in_channels`` or
            its images are smaller than ``min_size`` pixels (``small_cnn``: 8, DenseNet-BC: 4).
    """

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int, in_channels: int,
                 min_size: int = 1):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}.")
        if in_channels < 1:
            raise ValueError(f"in_channels must be at least 1, got {in_channels}.")
        self.in_channels = in_channels
        self.min_size = min_size  # smallest image height/width that G can take
        self.num_classes = num_classes
        self.feature_dim = feature_dim
        self.G = features
        self.F1 = nn.Linear(feature_dim, num_classes)
        self.F2 = nn.Linear(feature_dim, num_classes)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` with a fix if ``x`` is not an ``(N, in_channels, H, W)`` batch."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor of shape (N, C, H, W), got {type(x).__name__}.")
        if x.dim() != 4:
            hint = " Add a batch axis with x.unsqueeze(0)." if x.dim() == 3 else ""
            raise ValueError(
                f"expected an image batch of shape (N, C, H, W), got shape {tuple(x.shape)}.{hint}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"expected float images, got dtype {x.dtype}; convert with x.float() / 255 "
                             "(and normalise as the training data was).")
        param = next(self.parameters(), None)
        if (param is not None and param.dtype.is_floating_point and x.dtype != param.dtype
                and not torch.is_autocast_enabled(x.device.type)):
            raise ValueError(f"expected {param.dtype} images (the model's dtype), got {x.dtype}; convert the batch "
                             f"with x.to({param.dtype}) (or the model with model.to({x.dtype})).")
        if min(x.shape[2:]) < self.min_size:
            raise ValueError(f"images of {x.shape[2]}x{x.shape[3]} are too small for this model, which needs "
                             f"at least {self.min_size}x{self.min_size} (its pooling would leave nothing); "
                             "resize them, e.g. torchvision.transforms.Resize.")
        if x.shape[1] != self.in_channels:
            raise ValueError(
                f"this model takes {self.in_channels}-channel images, got {x.shape[1]} channels "
                f"(input shape {tuple(x.shape)}). Build the model with in_channels={x.shape[1]} "
                f"or convert the images (e.g. torchvision.transforms.Grayscale).")

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """G(x): ``(N, C, H, W)`` -> ``(N, D)``."""
        self.check_input(x)
        return self.G(x)

    def forward(self, x: torch.Tensor, detach_f2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(F1(G(x)), F2(G(x)))``, each ``(N, K)``.

        ``detach_f2=True`` is the official Step A forward ``(F1(G(x)), F2(G(x).detach()))``: F2's
        loss trains F2 only, not G. It is a forward argument (not a call of ``features`` and the
        heads from outside) so that a DistributedDataParallel wrapper sees every training forward.
        """
        feat = self.features(x)  # (N, D)
        return self.F1(feat), self.F2(feat.detach() if detach_f2 else feat)  # (N, K) each


# ----------------------------------------------------------------------------------------------
# small_cnn: CPU-sized, for 28x28 grayscale images
# ----------------------------------------------------------------------------------------------

def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        # 8 groups: per-sample statistics, so no coupling between samples of a batch (Wu & He 2018).
        return nn.GroupNorm(min(8, channels), channels)
    return nn.Identity()


def _conv_block(c_in: int, c_out: int, norm: str) -> list[nn.Module]:
    # The conv bias is redundant in front of a normalisation layer.
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=(norm == "none")), _norm(norm, c_out),
            nn.ReLU(inplace=True), nn.MaxPool2d(2)]


def small_cnn(in_channels: int = 1, num_classes: int = 10, norm: str = "batch",
              width: int = 32, dropout: float = 0.0) -> TwoHeadNet:
    """A 3-conv CNN for 28x28 images, 128-d features (CPU-sized: about 0.1 M parameters).

    G = 3 x [conv 3x3 -> norm -> ReLU -> max-pool 2] (widths ``width``, ``2*width``, ``4*width``),
    then global average pooling, a linear layer to 128 features and ReLU (and dropout if asked).

    Args:
        in_channels: image channels C.
        num_classes: number of ID classes K.
        norm: ``"batch"`` (BatchNorm2d), ``"group"`` (GroupNorm, 8 groups) or ``"none"``;
            no BatchNorm anywhere unless ``"batch"``.
        width: channels of the first conv layer.
        dropout: dropout probability before the heads (0 = none); used to teach that dropout
            masks differ between two forwards.

    Shapes:
        x: ``(N, in_channels, H, W)`` with H, W >= 8 -> two ``(N, num_classes)`` tensors.

    Raises:
        ValueError: on an unknown ``norm``, a dropout outside [0, 1) or a bad ``width``.
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}.")
    if width < 1 or in_channels < 1:
        raise ValueError(f"width and in_channels must be positive numbers of channels, got {width} and {in_channels}.")
    if norm == "group" and any(c % min(8, c) for c in (width, 2 * width, 4 * width)):
        raise ValueError(f"with norm='group' each block's channels ({width}, {2 * width}, {4 * width}) must split "
                         f"into min(8, channels) equal groups; use a width of 1, 2, 4 or a multiple of 8, got {width}.")
    w = width
    layers = (_conv_block(in_channels, w, norm) + _conv_block(w, 2 * w, norm)
              + _conv_block(2 * w, 4 * w, norm))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 128), nn.ReLU(inplace=True)]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return TwoHeadNet(nn.Sequential(*layers), 128, num_classes, in_channels, min_size=8)  # 3 max-pools


# ----------------------------------------------------------------------------------------------
# DenseNet-BC (Huang et al., "Densely Connected Convolutional Networks", CVPR 2017, arXiv 1608.06993)
# ----------------------------------------------------------------------------------------------

class _DenseLayer(nn.Module):
    """Bottleneck layer BN-ReLU-Conv1x1(4k)-BN-ReLU-Conv3x3(k); output concatenated to input."""

    def __init__(self, c_in: int, growth: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(c_in), nn.ReLU(inplace=True),
            nn.Conv2d(c_in, 4 * growth, 1, bias=False),
            nn.BatchNorm2d(4 * growth), nn.ReLU(inplace=True),
            nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], dim=1)  # (N, c_in + k, H, W)


def _transition(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm2d(c_in), nn.ReLU(inplace=True),
                         nn.Conv2d(c_in, c_out, 1, bias=False), nn.AvgPool2d(2))


def _densenet_bc_features(in_channels: int, depth: int, growth: int) -> tuple[nn.Module, int]:
    n = (depth - 4) // 6  # bottleneck layers per block: 16 for L=100
    channels = 2 * growth  # CIFAR stem: one 3x3 conv to 2k channels, no pooling
    layers: list[nn.Module] = [nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)]
    for block in range(3):
        for _ in range(n):
            layers.append(_DenseLayer(channels, growth))
            channels += growth
        if block < 2:  # compression theta = 0.5
            layers.append(_transition(channels, channels // 2))
            channels //= 2
    layers += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers), channels


def densenet_bc_100(in_channels: int = 3, num_classes: int = 10) -> TwoHeadNet:
    """DenseNet-BC (L=100, k=12), CIFAR variant with a 3x3 stem; 342-d features, about 0.8 M parameters.

    The paper's first network (Sec. 4.1); G ends with BN-ReLU-global average pooling.

    Shapes:
        x: ``(N, in_channels, 32, 32)`` (any H, W >= 4 works) -> two ``(N, num_classes)`` tensors.
    """
    features, dim = _densenet_bc_features(in_channels, depth=100, growth=12)
    assert dim == 342, dim  # published feature width
    return TwoHeadNet(features, dim, num_classes, in_channels, min_size=4)  # 2 average-pooling transitions


# ----------------------------------------------------------------------------------------------
# Wide ResNet (Zagoruyko & Komodakis, "Wide Residual Networks", BMVC 2016, arXiv 1605.07146)
# ----------------------------------------------------------------------------------------------

class _WideBasic(nn.Module):
    """Pre-activation basic block BN-ReLU-Conv3x3-BN-ReLU-Conv3x3 with a 1x1 shortcut on shape change."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.shortcut = (nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
                         if stride != 1 or c_in != c_out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))  # dropout 0 (the paper's setting) between the convs
        return out + skip


def _wrn_features(in_channels: int, depth: int, widen: int) -> tuple[nn.Module, int]:
    n = (depth - 4) // 6  # blocks per group: 4 for depth 28
    widths = [16, 16 * widen, 32 * widen, 64 * widen]
    layers: list[nn.Module] = [nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)]
    c_in = widths[0]
    for group, stride in zip(range(1, 4), (1, 2, 2)):
        for i in range(n):
            layers.append(_WideBasic(c_in, widths[group], stride if i == 0 else 1))
            c_in = widths[group]
    layers += [nn.BatchNorm2d(c_in), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers), c_in


def wrn_28_10(in_channels: int = 3, num_classes: int = 10) -> TwoHeadNet:
    """Wide ResNet 28-10 with dropout 0; 640-d features, about 36.5 M parameters.

    The paper's second network (Sec. 4.1).

    Shapes:
        x: ``(N, in_channels, 32, 32)`` -> two ``(N, num_classes)`` tensors.
    """
    features, dim = _wrn_features(in_channels, depth=28, widen=10)
    assert dim == 640, dim  # published feature width
    return TwoHeadNet(features, dim, num_classes, in_channels)


_BUILDERS = {"small_cnn": small_cnn, "densenet_bc_100": densenet_bc_100, "wrn_28_10": wrn_28_10}


def build_model(name: str, in_channels: int, num_classes: int, norm: str = "batch") -> TwoHeadNet:
    """Build a model by builder name (``norm`` applies to ``small_cnn`` only).

    Raises:
        ValueError: on an unknown name.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(_BUILDERS)}.")
    if name == "small_cnn":
        return small_cnn(in_channels, num_classes, norm=norm)
    return _BUILDERS[name](in_channels, num_classes)
