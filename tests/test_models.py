"""mcd_helpers.models: published sizes, the two heads on shared features, and the input checks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcd_helpers.models import (
    TwoHeadNet,
    build_model,
    densenet_bc_100,
    resnet_20,
    small_cnn,
    wrn_28_10,
)


def one_head_params(m):
    """Parameters of G and one head: the size the papers publish for a one-classifier network."""
    return sum(p.numel() for p in m.parameters()) - m.F2.weight.numel() - m.F2.bias.numel()


def test_densenet_bc_100_matches_the_published_size():
    # Huang et al. 2017, Table 2: DenseNet-BC (L=100, k=12) has 0.8 M parameters; 342 features by
    # hand: 24 + 16*12 = 216 -> 108 + 192 = 300 -> 150 + 192 = 342.
    m = densenet_bc_100(3, 10)
    assert m.feature_dim == 342 and m.F1.in_features == 342
    assert 0.75e6 < one_head_params(m) < 0.85e6


def test_wrn_28_10_matches_the_published_size_without_dropout():
    # Zagoruyko & Komodakis 2016, Table 1: WRN-28-10 has 36.5 M parameters.
    m = wrn_28_10(3, 10)
    assert m.feature_dim == 640
    assert one_head_params(m) == pytest.approx(36.5e6, rel=0.005)
    assert not any(isinstance(mod, nn.Dropout) for mod in m.modules())


def test_resnet_20_counts_its_parameters_by_hand():
    # He et al. 2016 (CIFAR ResNet-20: 0.27 M). By hand, 1 input channel, 6 classes: stem 16*9; a
    # block is BN(c_in) conv(c_in->c) BN(c) conv(c->c) (+ a 1x1 shortcut where the shape changes), a
    # BN is 2 per channel.
    def block(c_in, c):
        return 2 * c_in + 9 * c_in * c + 2 * c + 9 * c * c + (c_in * c if c_in != c else 0)  # noqa: E731

    stages = sum(block(c_in, c) + 2 * block(c, c) for c_in, c in ((16, 16), (16, 32), (32, 64)))
    m = resnet_20(1, 6)
    assert (
        sum(p.numel() for p in m.parameters())
        == 16 * 9 + stages + 2 * 64 + 2 * (64 * 6 + 6)
        == 272_124
    )
    assert m.feature_dim == 64 and sum(isinstance(x, nn.BatchNorm2d) for x in m.modules()) == 19


def test_small_cnn_is_cpu_sized_with_128_features():
    m = small_cnn()
    assert m.feature_dim == 128
    assert 0.05e6 < sum(p.numel() for p in m.parameters()) < 0.2e6  # "about 0.1 M"


@pytest.mark.parametrize(
    "build, shape, k",
    [
        (lambda: small_cnn(1, 10, "batch"), (3, 1, 28, 28), 10),
        (lambda: small_cnn(3, 7, "none", width=8), (3, 3, 32, 32), 7),
        (lambda: densenet_bc_100(1, 100), (2, 1, 32, 32), 100),
        (lambda: wrn_28_10(3, 10), (1, 3, 32, 32), 10),
        (lambda: build_model("resnet_20", 1, 6), (2, 1, 28, 28), 6),
        (lambda: build_model("small_cnn", 2, 5, "group"), (2, 2, 28, 28), 5),
        (lambda: build_model("densenet_bc_100", 3, 4), (2, 3, 16, 16), 4),
    ],
)
def test_forward_is_the_two_heads_on_shared_features(build, shape, k):
    m = build().eval()
    x = torch.randn(shape)
    with torch.no_grad():
        l1, l2 = m(x)
        feat = m.G(x)
        assert feat.shape == (shape[0], m.feature_dim)
        assert l1.shape == l2.shape == (shape[0], k)
        torch.testing.assert_close(l1, feat @ m.F1.weight.T + m.F1.bias)
        torch.testing.assert_close(l2, feat @ m.F2.weight.T + m.F2.bias)
    assert not torch.equal(m.F1.weight, m.F2.weight)  # two independent default initialisations


def test_build_model_builds_the_named_architecture():
    assert build_model("densenet_bc_100", 3, 10).feature_dim == 342
    assert build_model("wrn_28_10", 1, 10).G[0].in_channels == 1
    gn = build_model("small_cnn", 1, 10, "group")
    assert any(isinstance(m, nn.GroupNorm) for m in gn.modules())
    with pytest.raises(
        ValueError,
        match="'resnet18'.*small_cnn, resnet_20, densenet_bc_100, wrn_28_10",
    ):
        build_model("resnet18", 3, 10)


def test_detach_f2_trains_f2_only_from_its_loss():
    """Step A's forward: F2's loss reaches F2 but not G; the logits are the same either way."""
    m = small_cnn(norm="none", width=4).double()
    x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    l1, l2 = m(x, detach_f2=True)
    torch.testing.assert_close((l1, l2), m(x), rtol=0, atol=0)
    F.cross_entropy(l2, y).backward()
    assert all(p.grad is None for p in [*m.G.parameters(), *m.F1.parameters()])
    assert m.F2.weight.grad.abs().sum() > 0
    # without detaching, the same loss does reach G
    m.zero_grad()
    F.cross_entropy(m(x)[1], y).backward()
    assert m.G[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("norm, coupled", [("batch", True), ("group", False), ("none", False)])
def test_only_batchnorm_couples_the_samples_of_a_batch_in_train_mode(norm, coupled):
    # GroupNorm normalises per sample: sample 0's logits do not depend on the other samples.
    m = small_cnn(norm=norm, width=8).train()
    x = torch.randn(4, 1, 12, 12)
    with torch.no_grad():
        alone_with_a, alone_with_b = m(x[:2])[0][0], m(torch.cat([x[:1], 5 * x[2:]]))[0][0]
    assert (not torch.allclose(alone_with_a, alone_with_b, atol=1e-5)) == coupled


@pytest.mark.parametrize("width, groups", [(32, [8, 8, 8]), (4, [4, 8, 8]), (1, [1, 2, 4])])
def test_group_norm_uses_min_8_channels_groups(width, groups):
    m = small_cnn(norm="group", width=width)
    assert [g.num_groups for g in m.modules() if isinstance(g, nn.GroupNorm)] == groups


@pytest.mark.parametrize("build, size", [(small_cnn, 8), (densenet_bc_100, 4)])
def test_smallest_image_size_goes_through_and_one_less_is_refused(build, size):
    # by hand: small_cnn's three 2x2 max-pools take 8 -> 1; DenseNet's two 2x2 average pools take 4
    # -> 1
    m = build().eval()
    c = m.in_channels
    with torch.no_grad():
        assert m(torch.zeros(2, c, size, size))[0].shape == (2, 10)
    with pytest.raises(
        ValueError,
        match=f"{size - 1}x{size - 1}.*at least {size}x{size}",
    ):
        m(torch.zeros(2, c, size - 1, size - 1))


@pytest.mark.parametrize(
    "x, match",
    [
        (
            torch.zeros(1, 28, 28),
            r"shape \(1, 28, 28\).*\(N, C, H, W\).*x.unsqueeze\(0\)",
        ),
        (
            torch.zeros(2, 28 * 28),
            r"shape \(2, 784\).*\(N, C, H, W\)\.$",
        ),
        (
            torch.zeros(2, 1, 28, 28, dtype=torch.uint8),
            r"torch.uint8.*x.float\(\) / 255",
        ),
        (
            torch.zeros(2, 1, 28, 28, dtype=torch.float64),
            r"torch.float64.*torch.float32.*x.to\(torch.float32\)",
        ),
        (
            torch.zeros(2, 3, 28, 28),
            "3 channels.*takes 1.*in_channels=3",
        ),
    ],
)
def test_inputs_the_model_cannot_take_are_refused_with_the_fix(x, match):
    m = small_cnn(in_channels=1)
    with pytest.raises(ValueError, match=match):
        m(x)
    with pytest.raises(ValueError, match=match):
        m.features(x)


def test_non_tensor_input_is_a_type_error_and_matching_dtypes_work():
    with pytest.raises(TypeError, match=r"\(N, C, H, W\).*list"):
        small_cnn()([[0.0]])
    m = small_cnn().double().eval()
    assert m(torch.zeros(2, 1, 28, 28, dtype=torch.float64))[0].dtype == torch.float64
    # autocast casts inside the layers: not refused
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert small_cnn(norm="none", width=4).eval()(
            torch.zeros(2, 1, 8, 8, dtype=torch.bfloat16)
        )[0].shape == (2, 10)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(norm="layer"), r"norm='layer'"),
        (dict(dropout=1.0), r"\[0, 1\).*dropout=1.0"),
        (dict(dropout=-0.1), r"\[0, 1\).*dropout=-0.1"),
        (dict(width=0), "width=0"),
        (dict(in_channels=0), "in_channels=0"),
        (
            dict(width=12, norm="group"),
            r"1, 2, 4 or a multiple of 8, got 12",
        ),
        (dict(num_classes=1), "num_classes.*in_channels.*got 1 and 1"),
    ],
)
def test_bad_builder_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_cnn(**kwargs)


def test_two_head_net_refuses_a_one_class_or_channelless_model():
    with pytest.raises(ValueError, match="num_classes.*in_channels.*got 3 and 0"):
        TwoHeadNet(nn.Flatten(), 4, num_classes=3, in_channels=0)


def test_the_papers_networks_start_from_the_authors_initialisation():
    # official models/densenet.py: conv weights N(0, 2 / (k * k * out_channels)); BatchNorm 1 / 0;
    # the heads (official Classifier: nn.Linear) keep PyTorch's default
    torch.manual_seed(0)
    net = densenet_bc_100()
    convs = [m for m in net.G.modules() if isinstance(m, nn.Conv2d)]
    w = torch.cat(
        [
            m.weight.flatten() / (2 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels)) ** 0.5
            for m in convs
        ]
    )
    # standardised by the official std: mean 0, variance 1 over 0.8 M draws
    assert abs(w.mean().item()) < 0.01 and abs(w.var().item() - 1) < 0.01
    bns = [m for m in net.G.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(bool((m.weight == 1).all() and (m.bias == 0).all()) for m in bns)
    bound = 1 / net.feature_dim**0.5  # PyTorch's default for nn.Linear: U(-1/sqrt(in), 1/sqrt(in))
    assert net.F1.weight.abs().max() <= bound and net.F1.bias.abs().max() > 0
    # the CPU-sized networks keep PyTorch's defaults (kaiming_uniform with a = sqrt(5))
    first = next(m for m in resnet_20().G.modules() if isinstance(m, nn.Conv2d))
    assert first.weight.abs().max() <= 1 / (first.weight[0].numel()) ** 0.5
