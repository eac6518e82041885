import pytest
import torch
from torch import nn

from mcd_helpers.models import TwoHeadNet, build_model, densenet_bc_100, small_cnn, wrn_28_10


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_densenet_bc_100_size_matches_published():
    m = densenet_bc_100(in_channels=3, num_classes=10)
    assert m.feature_dim == 342
    # Huang et al. 2017, Table 2: DenseNet-BC (L=100, k=12) has 0.8 M parameters (one head of 3,430).
    assert 0.75e6 < n_params(m) - m.F2.weight.numel() - m.F2.bias.numel() < 0.85e6


def test_wrn_28_10_size_matches_published():
    m = wrn_28_10(in_channels=3, num_classes=10)
    assert m.feature_dim == 640
    # Zagoruyko & Komodakis 2016, Table 1 / README: WRN-28-10 has 36.5 M parameters.
    one_head = n_params(m) - m.F2.weight.numel() - m.F2.bias.numel()
    assert one_head == pytest.approx(36.5e6, rel=0.005)
    assert not any(isinstance(mod, nn.Dropout) for mod in m.modules())


@pytest.mark.parametrize("builder, shape", [
    (lambda: small_cnn(1, 10, "batch"), (4, 1, 28, 28)),
    (lambda: small_cnn(1, 10, "group"), (4, 1, 28, 28)),
    (lambda: small_cnn(3, 7, "none"), (4, 3, 32, 32)),
    (lambda: densenet_bc_100(3, 10), (2, 3, 32, 32)),
    (lambda: densenet_bc_100(1, 100), (2, 1, 32, 32)),
])
def test_forward_returns_two_logit_tensors(builder, shape):
    m = builder().eval()
    l1, l2 = m(torch.randn(shape))
    assert l1.shape == l2.shape == (shape[0], m.num_classes)
    assert isinstance(m, TwoHeadNet) and isinstance(m.F1, nn.Linear) and isinstance(m.F2, nn.Linear)


def test_wrn_forward_shape():
    m = wrn_28_10(3, 10).eval()
    with torch.no_grad():
        l1, l2 = m(torch.randn(1, 3, 32, 32))
    assert l1.shape == l2.shape == (1, 10)


@pytest.mark.parametrize("norm, has_bn, has_gn", [("batch", True, False), ("group", False, True),
                                                  ("none", False, False)])
def test_small_cnn_norm_layers(norm, has_bn, has_gn):
    mods = list(small_cnn(norm=norm).modules())
    assert any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in mods) == has_bn
    assert any(isinstance(m, nn.GroupNorm) for m in mods) == has_gn


def test_heads_are_distinct_linear_layers_on_shared_features():
    m = small_cnn()
    assert m.F1.weight.data_ptr() != m.F2.weight.data_ptr()
    assert not torch.equal(m.F1.weight, m.F2.weight)  # independent default initialisations
    x = torch.randn(3, 1, 28, 28)
    m.eval()
    feat = m.features(x)
    torch.testing.assert_close(m(x)[0], m.F1(feat))
    torch.testing.assert_close(m(x)[1], m.F2(feat))


def test_wrong_channels_raise_with_fix():
    with pytest.raises(ValueError, match="1-channel.*got 3 channels.*in_channels=3"):
        small_cnn(in_channels=1)(torch.randn(2, 3, 28, 28))


def test_missing_batch_axis_raises_with_hint():
    with pytest.raises(ValueError, match="unsqueeze"):
        small_cnn()(torch.randn(1, 28, 28))


@pytest.mark.parametrize("kwargs, match", [({"norm": "layer"}, r"norm must be one of \('batch', 'group', 'none'\), got 'layer'"),
                                           ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0")])
def test_bad_builder_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_cnn(**kwargs)


def test_build_model_by_name():
    assert build_model("small_cnn", 1, 10, "group").feature_dim == 128
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet18", 3, 10)


@pytest.mark.parametrize("build, x, match", [
    (lambda: small_cnn(), torch.zeros(2, 1, 7, 7), "at least 8x8"),
    (lambda: densenet_bc_100(), torch.zeros(2, 3, 3, 3), "at least 4x4"),
    (lambda: small_cnn(), torch.zeros(2, 1, 28, 28, dtype=torch.uint8), "float images"),
])
def test_inputs_the_model_cannot_take_are_refused_with_a_fix(build, x, match):
    with pytest.raises(ValueError, match=match):
        build()(x)


def test_smallest_accepted_images_go_through():
    # 8x8 after three 2x2 max-pools is 1x1: the smallest size small_cnn takes (by hand: 8 -> 4 -> 2 -> 1).
    l1, l2 = small_cnn().eval()(torch.zeros(2, 1, 8, 8))
    assert l1.shape == l2.shape == (2, 10)


@pytest.mark.parametrize("kwargs, match", [
    (dict(width=0), "width and in_channels must be positive numbers of channels, got 0 and 1"),
    (dict(width=12, norm="group"), r"channels \(12, 24, 48\) must split into min\(8, channels\) equal groups.*got 12"),
    (dict(in_channels=0), "width and in_channels must be positive numbers of channels, got 32 and 0"),
])
def test_bad_builder_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_cnn(**kwargs)


def test_a_float64_batch_into_a_float32_model_is_refused_with_the_fix():
    # Finding 8: a raw "mat1 and mat2 must have the same dtype" / "Input type (double) and bias type (float)".
    with pytest.raises(ValueError, match=r"expected torch.float32 images \(the model's dtype\), got torch.float64.*x.to\(torch.float32\)"):
        small_cnn()(torch.randn(2, 1, 28, 28, dtype=torch.float64))
    l1, _ = small_cnn().double().eval()(torch.randn(2, 1, 28, 28, dtype=torch.float64))  # matching dtypes work
    assert l1.dtype == torch.float64
