"""Two-head networks for MCD: a shared feature extractor G and two linear classifiers F1, F2.

Paper: Q. Yu, K. Aizawa, "Unsupervised Out-of-Distribution Detection by Maximum Classifier
Discrepancy", ICCV 2019 (arXiv 1908.04951), Sec. 3 and Fig. 2. The official code
(github.com/YU1ut/UOOD-MCD, ``models/``) builds G as a DenseNet or WRN without its last linear layer
and F1, F2 as one ``nn.Linear`` each with PyTorch's default initialisation. Builders (torchvision
style), each a plain :class:`TwoHeadNet`:

* :func:`small_cnn` -- a CPU-sized 3-conv net for 28x28 Fashion-MNIST, ``norm`` selectable;
* :func:`densenet_bc_100` -- DenseNet-BC, L=100, k=12, CIFAR stem (Huang et al., CVPR 2017), 342-d
  features;
* :func:`resnet_20` -- a pre-activation ResNet-20 (16/32/64 channels), 64-d features, for the CPU;
* :func:`wrn_28_10` -- Wide ResNet 28-10, dropout 0 (Zagoruyko & Komodakis, BMVC 2016), 640-d
  features.

The paper's two networks start from the official code's initialisation (:func:`authors_init`); the
CPU-sized ones from PyTorch's defaults.
"""

import torch
from torch import nn

NORMS = ("batch", "group", "none")  # small_cnn's normalisation layers


class TwoHeadNet(nn.Module):
    """Shared feature extractor ``G`` (``(N, C, H, W)`` -> ``(N, feature_dim)``) and two linear
    heads ``F1``, ``F2``.

    Shapes:
        x: ``(N, in_channels, H, W)`` with H, W >= ``min_size`` -> ``(logits1, logits2)``, each
        ``(N, num_classes)``.

    Raises:
        ValueError: (every forward) ``x`` not a 4-D float batch of the model's dtype, with
            ``in_channels`` channels and images of at least ``min_size`` pixels; the message says
            how to fix it.
    """

    def __init__(
        self,
        features: nn.Module,
        feature_dim: int,
        num_classes: int,
        in_channels: int,
        min_size: int = 1,
    ):
        super().__init__()
        if num_classes < 2 or in_channels < 1:
            raise ValueError(
                f"num_classes must be >= 2 and in_channels >= 1, got {num_classes} and "
                f"{in_channels}."
            )
        self.in_channels, self.min_size, self.num_classes, self.feature_dim = (
            in_channels,
            min_size,
            num_classes,
            feature_dim,
        )
        self.G, self.F1, self.F2 = (
            features,
            nn.Linear(feature_dim, num_classes),
            nn.Linear(feature_dim, num_classes),
        )

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """G(x): ``(N, C, H, W)`` -> ``(N, D)``; ``TypeError``/``ValueError`` with the fix when
        ``x`` does not fit."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"expected a torch.Tensor of shape (N, C, H, W), got {type(x).__name__}."
            )
        param = next(self.parameters())
        problem = (
            f"got shape {tuple(x.shape)}; expected an image batch (N, C, H, W)"
            + (": add a batch axis with x.unsqueeze(0)" if x.dim() == 3 else "")
            if x.dim() != 4
            else f"got dtype {x.dtype}; convert with x.float() / 255 (and normalise as in training)"
            if not x.dtype.is_floating_point
            else f"got {x.dtype} images for a {param.dtype} model; convert with "
            f"x.to({param.dtype}) (or the model)"
            if x.dtype != param.dtype and not torch.is_autocast_enabled(x.device.type)
            else f"got {x.shape[2]}x{x.shape[3]} images; this model needs at least "
            f"{self.min_size}x{self.min_size} (its pooling would leave nothing): resize them"
            if min(x.shape[2:]) < self.min_size
            else f"got {x.shape[1]} channels; this model takes {self.in_channels}: build it "
            "with in_channels="
            f"{x.shape[1]} or convert the images (torchvision.transforms.Grayscale)"
            if x.shape[1] != self.in_channels
            else ""
        )
        if problem:
            raise ValueError(problem + ".")
        return self.G(x)

    def forward(
        self, x: torch.Tensor, detach_f2: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(F1(G(x)), F2(G(x)))``, each ``(N, K)``. ``detach_f2=True`` is the official Step A
        forward ``(F1(G(x)), F2(G(x).detach()))``: F2's loss trains F2 only. A forward argument, not
        calls of ``features`` and the heads from outside, so that a DistributedDataParallel wrapper
        sees every training forward."""
        feat = self.features(x)  # (N, D)
        return self.F1(feat), self.F2(feat.detach() if detach_f2 else feat)  # (N, K) each


def small_cnn(
    in_channels: int = 1,
    num_classes: int = 10,
    norm: str = "batch",
    width: int = 32,
    dropout: float = 0.0,
) -> TwoHeadNet:
    """A 3-conv CNN for 28x28 images, 128-d features, about 0.1 M parameters (CPU-sized).

    G = 3 x [conv 3x3 (no bias before a norm) -> norm -> ReLU -> max-pool 2] (widths ``width``,
    ``2 width``, ``4 width``), global average pooling, linear to 128, ReLU, dropout if asked.
    ``norm``: ``"batch"``, ``"group"`` (GroupNorm, 8 groups: per-sample statistics, Wu & He 2018) or
    ``"none"``; ``dropout`` is there to teach that two forwards draw different masks.

    Shapes: ``(N, in_channels, H, W)`` with H, W >= 8 -> two ``(N, num_classes)``.

    Raises:
        ValueError: an unknown ``norm``, a dropout outside [0, 1), a width that GroupNorm cannot
        split.
    """
    if norm not in NORMS or not 0.0 <= dropout < 1.0 or width < 1 or in_channels < 1:
        raise ValueError(
            f"norm must be one of {NORMS}, dropout in [0, 1), width and in_channels >= 1; got "
            f"norm={norm!r}, dropout={dropout}, width={width}, in_channels={in_channels}."
        )
    if norm == "group" and any(c % min(8, c) for c in (width, 2 * width, 4 * width)):
        raise ValueError(
            "with norm='group' the widths must split into min(8, channels) groups: use a "
            f"width of 1, 2, 4 or a multiple of 8, got {width}."
        )
    layer_norm = {
        "batch": nn.BatchNorm2d,
        "group": lambda w: nn.GroupNorm(min(8, w), w),
        "none": lambda w: nn.Identity(),
    }
    layers = []
    for c, w in zip((in_channels, width, 2 * width), (width, 2 * width, 4 * width)):
        layers += [
            nn.Conv2d(c, w, 3, padding=1, bias=norm == "none"),
            layer_norm[norm](w),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        ]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, 128), nn.ReLU(inplace=True)]
    layers += [nn.Dropout(dropout)] if dropout > 0 else []
    # 3 max-pools
    return TwoHeadNet(nn.Sequential(*layers), 128, num_classes, in_channels, min_size=8)


class _DenseLayer(nn.Module):
    """Bottleneck BN-ReLU-Conv1x1(4k)-BN-ReLU-Conv3x3(k); its output concatenated to its input."""

    def __init__(self, c_in: int, growth: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(c_in),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_in, 4 * growth, 1, bias=False),
            nn.BatchNorm2d(4 * growth),
            nn.ReLU(inplace=True),
            nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], dim=1)  # (N, c_in + k, H, W)


def authors_init(g: nn.Module) -> nn.Module:
    """The official code's initialisation of a feature extractor G, in place: every ``Conv2d``
    weight drawn from N(0, 2 / (k_h k_w C_out)) (He et al., ICCV 2015, with fan-out), every
    ``BatchNorm2d`` weight 1 and bias 0; github.com/YU1ut/UOOD-MCD at 1ab5ff6,
    ``models/densenet.py`` lines 102-110 and ``models/wideresnet.py`` lines 67-75, the loop
    closing each ``__init__``. Its classifiers F1, F2 (``Classifier``, one ``nn.Linear``) keep
    PyTorch's default, as here. Returns ``g``."""
    for m in g.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return g


def densenet_bc_100(in_channels: int = 3, num_classes: int = 10) -> TwoHeadNet:
    """DenseNet-BC (L=100, k=12), CIFAR variant (one 3x3 stem conv to 2k channels, no pooling),
    compression 0.5; G ends with BN-ReLU-global average pooling: 342-d features, about 0.8 M
    parameters, initialised as the official code does (:func:`authors_init`). The paper's first
    network.

    Shapes: ``(N, in_channels, 32, 32)`` (any H, W >= 4) -> two ``(N, num_classes)``.
    """
    growth, channels = 12, 24
    layers: list[nn.Module] = [nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)]
    for block in range(3):
        # (L - 4) / 6 bottlenecks per block
        layers += [_DenseLayer(channels + i * growth, growth) for i in range(16)]
        channels += 16 * growth
        if block < 2:  # transition: BN-ReLU-Conv1x1 to half the channels, average pooling
            layers.append(
                nn.Sequential(
                    nn.BatchNorm2d(channels),
                    nn.ReLU(inplace=True),
                    nn.Conv2d(channels, channels // 2, 1, bias=False),
                    nn.AvgPool2d(2),
                )
            )
            channels //= 2
    layers += [
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    ]
    assert channels == 342, channels  # the published feature width
    # 2 pooling transitions
    g = authors_init(nn.Sequential(*layers))
    return TwoHeadNet(g, channels, num_classes, in_channels, min_size=4)


class _WideBasic(nn.Module):
    """Pre-activation block BN-ReLU-Conv3x3-BN-ReLU-Conv3x3 (dropout 0), a 1x1 shortcut on a change
    of shape."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.bn1, self.conv1 = (
            nn.BatchNorm2d(c_in),
            nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        )
        self.bn2, self.conv2 = (
            nn.BatchNorm2d(c_out),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        )
        self.shortcut = (
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
            if stride != 1 or c_in != c_out
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        return self.conv2(torch.relu(self.bn2(self.conv1(out)))) + (
            x if self.shortcut is None else self.shortcut(out)
        )


def _preact_resnet(
    in_channels: int, num_classes: int, widths: tuple[int, int, int], blocks: int
) -> TwoHeadNet:
    """A 3x3 stem to 16 channels, three stages of ``blocks`` :class:`_WideBasic` blocks (widths
    ``widths``, strides 1, 2, 2), BN-ReLU-global average pooling: ``widths[-1]``-d features."""
    layers, c_in = [nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)], 16
    for width, stride in zip(widths, (1, 2, 2)):
        layers += [
            _WideBasic(width if i else c_in, width, 1 if i else stride) for i in range(blocks)
        ]
        c_in = width
    layers += [nn.BatchNorm2d(c_in), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return TwoHeadNet(nn.Sequential(*layers), c_in, num_classes, in_channels)


def wrn_28_10(in_channels: int = 3, num_classes: int = 10) -> TwoHeadNet:
    """Wide ResNet 28-10 with dropout 0: 640-d features, about 36.5 M parameters, initialised as the
    official code does (:func:`authors_init`). The paper's second network.

    Shapes: ``(N, in_channels, 32, 32)`` -> two ``(N, num_classes)``.
    """
    # 16, 32, 64 x widen 10; (depth - 4) / 6
    net = _preact_resnet(in_channels, num_classes, (160, 320, 640), 4)
    authors_init(net.G)
    return net


def resnet_20(in_channels: int = 1, num_classes: int = 10) -> TwoHeadNet:
    """A pre-activation ResNet-20 (He et al., ECCV 2016; CIFAR layout: 3 stages of 3 blocks,
    16/32/64 channels): 64-d features, about 0.27 M parameters, BatchNorm in every block. The deeper
    CPU-sized BatchNorm network of the near-OOD benchmark (preset ``depth``).

    Shapes: ``(N, in_channels, H, W)`` (28x28 or 32x32) -> two ``(N, num_classes)``.
    """
    return _preact_resnet(in_channels, num_classes, (16, 32, 64), 3)


# name -> builder
MODELS = {
    "small_cnn": small_cnn,
    "resnet_20": resnet_20,
    "densenet_bc_100": densenet_bc_100,
    "wrn_28_10": wrn_28_10,
}


def build_model(name: str, in_channels: int, num_classes: int, norm: str = "batch") -> TwoHeadNet:
    """One of :data:`MODELS` by name (``norm``: ``small_cnn`` only). ``ValueError`` on another
    name."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}.")
    return MODELS[name](in_channels, num_classes, **({"norm": norm} if name == "small_cnn" else {}))


@torch.inference_mode()
def predict_logits(
    model: nn.Module, x: torch.Tensor, batch_size: int = 1000, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both heads' logits in eval mode, ``batch_size`` images a forward (the mode is restored).

    Shapes: ``(N, C, H, W)`` -> two ``(N, K)`` tensors on the CPU.
    """
    was_training = model.training
    model.eval()
    try:
        outs = [model(x[i : i + batch_size].to(device)) for i in range(0, len(x), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat([o[0] for o in outs]).cpu(), torch.cat([o[1] for o in outs]).cpu()
