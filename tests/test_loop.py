"""The training loop (mcd_helpers/experiments/loop.py): data order, one iteration written out, lr
decay, the history, non-finite losses, interruption and exact resume.

Tiny settings: ``small_cnn(width=4)`` on 8x8 images, 48 labeled and 40 unlabeled; every number is
checked against a computation of this file (the data order from NumPy's SeedSequence, one MCD
iteration by hand in float64, a brute-force AUROC) or against an uninterrupted run (same process,
CPU, same thread count: exact).
"""

import copy
import dataclasses
import math
import re
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from signal_on_call import signal_on_call
from torch import nn

import mcd_helpers.experiments.loop as train_mod
from mcd_helpers.errors import ConfigError, TrainingInterrupted
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.loop import LABELED, UNLABELED, Batches, train
from mcd_helpers.models import TwoHeadNet, predict_logits, small_cnn
from mcd_helpers.splits import transductive_split


def _perm(n: int, seed: int, stream: int, p: int) -> torch.Tensor:
    """Pass ``p`` of a stream, written out: SeedSequence([seed, stream, p]) -> 63-bit seed ->
    randperm."""
    state = (
        int(np.random.SeedSequence([seed, stream, p]).generate_state(1, dtype=np.uint64)[0]) >> 1
    )
    return torch.randperm(n, generator=torch.Generator().manual_seed(state))


def _split(dtype=torch.float32):
    """48 labeled images of 3 classes (mean brightness = class), 30 ID + 30 OOD test images, 10 + 10
    validation."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(48) % 3
    x = torch.randn(48, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1)
    id_y = torch.arange(30) % 3
    id_x = torch.randn(30, 1, 8, 8, generator=g) + id_y.view(-1, 1, 1, 1)
    ood_x = 4 * torch.rand(30, 1, 8, 8, generator=g) - 2
    s = transductive_split(x.to(dtype), y, id_x.to(dtype), id_y, ood_x.to(dtype), n_val=10, seed=3)
    assert len(s.x_unsup) == 40
    return s


def _cfg(**overrides) -> MCDConfig:
    base = dict(
        seed=0,
        finetune_epochs=2,
        steps_per_epoch=4,
        batch_size_sup=8,
        batch_size_unsup=8,
        finetune_lr=0.05,
        margin=0.5,
        eval_batch_size=64,
        checkpoint_every=3,
        pretrain_epochs=2,
        pretrain_batch_size=16,
        pretrain_milestones=(1,),
        pretrain_lr=0.05,
    )
    return MCDConfig(**{**base, **overrides})


def _model(seed: int = 0, dropout: float = 0.0) -> TwoHeadNet:
    torch.manual_seed(seed)
    return small_cnn(1, 3, width=4, dropout=dropout)


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- Batches -------------------------------------------------------------------------------------


def test_each_pass_is_a_permutation_dealt_into_batches_the_rest_dropped():
    b = Batches(20, 6, seed=0, stream=0)
    assert b.per_pass == 3
    for p in (0, 1):
        seen = torch.cat([b.batch(p, i) for i in range(3)])
        assert sorted(b.permutation(p).tolist()) == list(range(20))
        # 3 batches of 6, the last 2 samples dropped
        assert torch.equal(seen, b.permutation(p)[:18])
    assert not torch.equal(b.permutation(0), b.permutation(1))


@pytest.mark.parametrize("seed, stream", [(5, 2), (0, LABELED), (2**32 - 1, UNLABELED)])
def test_a_pass_is_randperm_from_the_seed_sequence_of_seed_stream_and_pass(seed, stream):
    b = Batches(30, 4, seed=seed, stream=stream)
    b.batch(4, 0)  # another pass visited first: no hidden state may leak into pass 3
    want = _perm(30, seed, stream, 3)
    assert torch.equal(b.permutation(3), want)
    assert torch.equal(b.batch(3, 1), want[4:8])
    # 7 batches per pass: batch 22 is pass 3, batch 1
    assert torch.equal(b.batch_at(7 * 3 + 1), want[4:8])
    assert not torch.equal(want, _perm(30, seed, stream + 1, 3))


@pytest.mark.parametrize("n, b, w", [(37, 8, 2), (64, 12, 3), (10, 4, 4)])
def test_the_ranks_shares_are_disjoint_and_make_up_the_single_process_batch(n, b, w):
    one = Batches(n, b, seed=5, stream=1)
    ranks = [Batches(n, b, seed=5, stream=1, rank=r, world_size=w) for r in range(w)]
    for k in range(2 * one.per_pass + 1):
        shares = [r.batch_at(k) for r in ranks]
        union = torch.cat(shares).tolist()
        assert all(len(s) == b // w for s in shares) and len(set(union)) == b
        assert sorted(union) == sorted(one.batch_at(k).tolist())
        assert torch.equal(shares[-1], one.batch_at(k)[w - 1 :: w])


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (
            dict(n=5, batch_size=8),
            ValueError,
            r"batch_size.*\b5\b.*\b8\b",
        ),
        (dict(n=5, batch_size=0), ValueError, r"batch_size.*\b5\b.*\b0\b"),
        (
            dict(n=50, batch_size=10, world_size=4),
            ValueError,
            r"\b10\b.*--nproc_per_node=4\b",
        ),
    ],
)
def test_batches_refuse_bad_sizes(kwargs, err, match):
    with pytest.raises(err, match=match):
        Batches(seed=0, stream=0, **kwargs)


def test_a_batch_beyond_the_pass_is_refused():
    with pytest.raises(IndexError, match=r"\b2 batches\b.*\bbatch 2\b"):
        Batches(10, 5, seed=0, stream=0).batch(0, 2)


# ---- predict_logits ------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False])
def test_predict_logits_is_the_eval_mode_forward_in_batches_and_restores_the_mode(training):
    model, x = _model(dropout=0.5), _split().test_id_x  # (20, 1, 8, 8)
    model.train(training)
    l1, l2 = predict_logits(model, x, batch_size=7)  # batches of 7, 7, 6
    assert model.training is training and all(m.training is training for m in model.modules())
    model.eval()
    with torch.no_grad():
        w1, w2 = model(x)  # eval mode: BatchNorm's running statistics, no dropout, one batch
    assert l1.shape == (20, 3) and l1.device.type == "cpu"
    torch.testing.assert_close(l1, w1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l2, w2, rtol=1e-6, atol=1e-6)


# ---- one official iteration written out ----------------------------------------------------------


def _entropy(logits):
    return -(F.softmax(logits, 1) * F.log_softmax(logits, 1)).sum(1)


def _by_hand(model, xs, ys, xu, cfg, strategy, detach_f2=True):
    """One fine-tuning iteration, float64: Step A (official schedule) then Step B, each followed by
    an SGD step ``v = momentum v + (g + wd p); p -= lr v`` written out, the momentum shared by the
    two steps."""
    net = copy.deepcopy(model).train()
    # BatchNorm normalises with its running statistics and keeps them
    if strategy.startswith("eval-bn"):
        for m in net.modules():
            m.train(not isinstance(m, nn.BatchNorm2d))
    params, bufs, parts = list(net.parameters()), {}, {}

    def sgd(loss):
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                d = g + cfg.finetune_weight_decay * p
                bufs[p] = d.clone() if p not in bufs else cfg.finetune_momentum * bufs[p] + d
                p -= cfg.finetune_lr * bufs[p]

    if cfg.schedule == "official":
        # labeled rows' features
        feat = net.G(torch.cat([xs, xu]))[: len(xs)] if strategy == "concat-both" else net.G(xs)
        loss_a = F.cross_entropy(net.F1(feat), ys) + F.cross_entropy(
            net.F2(feat.detach() if detach_f2 else feat), ys
        )
        parts["step_a"] = loss_a.item()
        sgd(loss_a)
    if strategy in ("concat", "concat-both", "eval-bn-concat"):
        l1, l2 = net(torch.cat([xs, xu]))
        (l1s, l1u), (l2s, l2u) = l1.split([len(xs), len(xu)]), l2.split([len(xs), len(xu)])
    else:
        (l1s, l2s), (l1u, l2u) = net(xs), net(xu)
    ce = F.cross_entropy(l1s, ys) + F.cross_entropy(l2s, ys)
    gap = (_entropy(l1u) - _entropy(l2u)).mean()
    dis = torch.clamp(cfg.margin - gap, min=0)
    parts.update(ce=ce.item(), dis=dis.item(), gap=gap.item())
    sgd(ce + dis)
    return net, parts


@pytest.mark.parametrize(
    "strategy, schedule",
    [
        ("separate", "official"),
        ("concat", "official"),
        ("separate", "step_b"),
        ("concat-both", "official"),
        ("eval-bn", "official"),
        ("eval-bn-concat", "official"),
    ],
)
def test_one_iteration_written_out_in_float64_equals_train(strategy, schedule):
    split = _split(torch.float64)
    model = _model().double()
    cfg = _cfg(finetune_epochs=1, steps_per_epoch=1, schedule=schedule, finetune_weight_decay=0.01)
    # pass 0, batch 0 of each stream
    i_sup, i_unsup = (_perm(48, 0, LABELED, 0)[:8], _perm(40, 0, UNLABELED, 0)[:8])
    xs, ys, xu = split.x_sup[i_sup], split.y_sup[i_sup], split.x_unsup[i_unsup]
    want, parts = _by_hand(model, xs, ys, xu, cfg, strategy)
    got = copy.deepcopy(model)
    out = train(got, split, cfg, strategy, progress=False)
    for (k, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=k)  # weights and BatchNorm buffers
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(want.state_dict().values(), model.state_dict().values())
        if a.is_floating_point()
    )
    assert moved > 1e-3  # not vacuous: the iteration changed the network
    h = out["history"]
    for name, value in parts.items():  # the history holds float32 copies of the losses
        assert getattr(h, name) == [pytest.approx(value, rel=1e-6, abs=1e-7)], name
    if schedule == "step_b":
        assert h.step_a == []
    # F2 on features that are not detached: other weights
    if schedule == "official" and strategy == "separate":
        other, _ = _by_hand(model, xs, ys, xu, cfg, strategy, detach_f2=False)
        assert (
            max((a - b).abs().max().item() for a, b in zip(other.parameters(), got.parameters()))
            > 1e-6
        )


def test_concat_both_differs_from_concat_and_eval_mode_batchnorm_makes_concat_and_separate_equal():
    split, cfg = _split(torch.float64), _cfg(finetune_epochs=1, steps_per_epoch=3)
    nets = {
        s: copy.deepcopy(_model().double())
        for s in ("concat", "concat-both", "eval-bn", "eval-bn-concat")
    }
    for s, net in nets.items():
        train(net, split, cfg, s, progress=False)

    def gap(a, b):
        return max(
            (x - y).abs().max().item()
            for x, y in zip(
                nets[a].state_dict().values(),  # noqa: E731
                nets[b].state_dict().values(),
            )
            if x.is_floating_point()
        )

    assert gap("concat", "concat-both") > 1e-4  # Step A's statistics changed the weights
    # no coupling: the same network to float64 rounding
    assert gap("eval-bn", "eval-bn-concat") < 1e-12
    assert gap("eval-bn", "concat") > 1e-4
    bns = lambda net: [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]  # noqa: E731
    assert bns(nets["concat"]) and all(
        torch.equal(a.running_mean, b.running_mean)  # eval mode: the statistics kept
        for a, b in zip(bns(_model().double()), bns(nets["eval-bn"]))
    )


@pytest.mark.parametrize("momentum", [0.0, 1.0])
def test_bn_momentum_changes_the_running_statistics_and_not_the_weights(momentum):
    """One iteration at bn_momentum 0 or 1 equals the one written out with
    nn.BatchNorm2d(momentum=...); the weights equal those at the default 0.1 (train mode normalises
    with the batch's statistics); momentum 0 keeps the pre-trained running statistics, 1 replaces
    them."""
    split, model = _split(torch.float64), _model().double()
    cfg, default = (
        _cfg(finetune_epochs=1, steps_per_epoch=1, bn_momentum=momentum),
        _cfg(finetune_epochs=1, steps_per_epoch=1),
    )
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = momentum
    i_sup, i_unsup = _perm(48, 0, LABELED, 0)[:8], _perm(40, 0, UNLABELED, 0)[:8]
    want, _ = _by_hand(
        ref, split.x_sup[i_sup], split.y_sup[i_sup], split.x_unsup[i_unsup], cfg, "separate"
    )
    got, usual = copy.deepcopy(model), copy.deepcopy(model)
    train(got, split, cfg, "separate", progress=False)
    train(usual, split, default, "separate", progress=False)
    for (k, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=k)
    # the same weights
    assert all(torch.equal(a, b) for a, b in zip(got.parameters(), usual.parameters()))
    stats = lambda net: [m.running_mean for m in net.modules() if isinstance(m, nn.BatchNorm2d)]  # noqa: E731
    before, after, at_default = stats(model), stats(got), stats(usual)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) == (momentum == 0)
    assert min((a - b).abs().max().item() for a, b in zip(after, at_default)) > 1e-6


# ---- learning rate, history, model selection -----------------------------------------------------


@pytest.mark.parametrize(
    "strategy, milestones, factors",
    [
        (None, (), [1, 1, 1]),
        (None, (1,), [1, 0.1, 0.1]),
        (None, (1, 2), [1, 0.1, 0.01]),
        # fine-tuning: a constant lr, whatever the pre-training milestones
        ("separate", (1, 2), [1, 1, 1]),
    ],
)
def test_pretraining_decays_the_lr_at_its_milestones_and_fine_tuning_keeps_it(
    monkeypatch, strategy, milestones, factors
):
    lrs, real = [], torch.optim.SGD.step

    def spy(self, *args, **kwargs):
        lrs.append(self.param_groups[0]["lr"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", spy)
    cfg = _cfg(
        pretrain_epochs=3,
        finetune_epochs=3,
        steps_per_epoch=2,
        pretrain_milestones=milestones,
        schedule="step_b",
    )
    train(_model(), _split(), cfg, strategy, progress=False)
    # 48 // 16 = 3 pre-training steps
    lr, steps = (cfg.pretrain_lr, 3) if strategy is None else (cfg.finetune_lr, 2)
    assert lrs == pytest.approx([lr * f for f in factors for _ in range(steps)], rel=1e-12)


@pytest.mark.parametrize(
    "strategy, schedule, steps_per_epoch, steps",
    [
        (None, "official", 2, 3),  # pre-training: always a whole pass (48 // 16), CE only
        ("concat", "official", 2, 2),
        ("separate", "step_b", 0, 6),  # 0: one pass over the labeled set (48 // 8)
        ("separate", "official", 99, 6),  # a cap above the pass: the pass
    ],
)
def test_the_history_has_a_value_per_step_and_an_auroc_per_epoch(
    strategy, schedule, steps_per_epoch, steps
):
    cfg = _cfg(
        finetune_epochs=3, pretrain_epochs=3, steps_per_epoch=steps_per_epoch, schedule=schedule
    )
    seen = []
    h = train(
        _model(),
        _split(),
        cfg,
        strategy,
        progress=False,
        on_epoch=lambda e, hist: seen.append((e, len(hist.ce), len(hist.val_auroc))),
    )["history"]
    fine = strategy is not None
    assert len(h.ce) == 3 * steps
    assert [len(v) for v in (h.dis, h.gap, h.val_auroc)] == (
        [3 * steps, 3 * steps, 3] if fine else [0, 0, 0]
    )
    assert len(h.step_a) == (3 * steps if fine and schedule == "official" else 0)
    assert seen == ([(e, steps * (e + 1), e + 1) for e in range(3)] if fine else [])


def _auroc(s_id, s_ood) -> float:
    """P(OOD score > ID score) + P(tie) / 2 over every pair, brute force."""
    a, b = np.asarray(s_ood, dtype=np.float64)[:, None], np.asarray(s_id, dtype=np.float64)[None, :]
    return float(((a > b) + 0.5 * (a == b)).mean())


def _discrepancy(model, x):
    model.eval()
    with torch.no_grad():
        l1, l2 = model(x)
    return (F.softmax(l1, 1) - F.softmax(l2, 1)).abs().sum(1)


@pytest.mark.parametrize("tied", [False, True])
def test_each_epochs_auroc_is_the_validation_discrepancy_auroc_and_best_is_its_first_best_epoch(
    tied,
):
    split, snapshots, aurocs = _split(), [], []
    # the same images as ID and OOD: every epoch's AUROC is 1/2, and the first epoch is kept
    if tied:
        split = dataclasses.replace(split, val_ood_x=split.val_id_x)
    model = _model()

    def on_epoch(epoch, hist):  # the network right after the epoch, scored here
        net = copy.deepcopy(model)
        snapshots.append(copy.deepcopy(model.state_dict()))
        aurocs.append(_auroc(_discrepancy(net, split.val_id_x), _discrepancy(net, split.val_ood_x)))

    out = train(
        model,
        split,
        _cfg(finetune_epochs=4, steps_per_epoch=2),
        "concat",
        progress=False,
        on_epoch=on_epoch,
    )
    assert out["history"].val_auroc == pytest.approx(aurocs, abs=1e-12)
    first_best = max(range(4), key=lambda i: (aurocs[i], -i))
    if tied:
        assert aurocs == [0.5] * 4 and first_best == 0
    _same_state(out["best"], snapshots[first_best])
    _same_state(out["last"], snapshots[-1])
    _same_state(model.state_dict(), snapshots[-1])  # the model holds the last epoch's weights


# ---- non-finite losses ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_pretraining_loss_names_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path, monkeypatch, bad
):
    real, calls = train_mod.supervised_loss, [0]

    def poisoned(*args):  # from its 4th call on (epoch 2, step 1) the loss is NaN or inf
        calls[0] += 1
        return real(*args) * (bad if calls[0] >= 4 else 1.0)

    monkeypatch.setattr(train_mod, "supervised_loss", poisoned)
    ckpt = tmp_path / "pretrain.pt"
    with pytest.raises(
        FloatingPointError,
        match=rf"pre-training.*epoch 2 step 1.*ce={bad}\b.*{re.escape(str(ckpt))}",
    ):
        # 3 steps an epoch
        train(_model(), _split(), _cfg(checkpoint_every=2), progress=False, checkpoint=ckpt)
    state = torch.load(ckpt, weights_only=True)
    # epoch 1's end, not step 4's
    assert (state["epoch"], state["step"], len(state["history"]["ce"])) == (1, 0, 3)
    assert (
        all(torch.isfinite(v).all() for v in state["model"].values())
        and np.isfinite(state["history"]["ce"]).all()
    )


class _NaNAfter(nn.Module):
    """Flatten -> Linear; from the (k+1)-th call on, the features are NaN."""

    def __init__(self, k: int):
        super().__init__()
        self.body, self.k, self.calls = nn.Sequential(nn.Flatten(), nn.Linear(64, 16)), k, 0

    def forward(self, x):
        self.calls += 1
        return self.body(x) * (math.nan if self.calls > self.k else 1.0)


def test_a_non_finite_fine_tuning_loss_names_every_part(tmp_path):
    # Step B alone, concat: one call of G per step; after epoch 1 (calls 1-4) the validation calls
    # it twice (5, 6), so call 9 is epoch 2's step 3. The check runs at the next checkpoint (epoch
    # 2's end), before saving.
    torch.manual_seed(0)
    ckpt = tmp_path / "mcd.pt"
    with pytest.raises(
        FloatingPointError,
        match=r"fine-tuning \(concat\).*epoch 2 step 3.*ce=nan, dis=nan, gap=nan.*"
        + re.escape(str(ckpt)),
    ):
        train(
            TwoHeadNet(_NaNAfter(k=8), 16, 3, 1),
            _split(),
            _cfg(schedule="step_b"),
            "concat",
            progress=False,
            checkpoint=ckpt,
        )
    state = torch.load(ckpt, weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 2)  # saved after global step 6, the last good one
    assert np.isfinite([v for k in ("ce", "dis", "gap") for v in state["history"][k]]).all()


# ---- interruption and exact resume ---------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, name, k, sig, match, where",
    [
        (
            None,
            "supervised_loss",
            5,
            signal.SIGTERM,
            r"SIGTERM.*pre-training 2/2.*step 2/3",
            (1, 2),
        ),
        (
            "separate",
            "mcd_step",
            6,
            signal.SIGINT,
            r"SIGINT.*fine-tuning \(separate\) 2/2.*step 2/4",
            (1, 2),
        ),
        (
            "concat",
            "predict_logits",
            1,
            signal.SIGTERM,
            r"SIGTERM.*fine-tuning \(concat\) 1/2\b",
            (1, 0),
        ),
    ],
)
def test_an_interrupted_run_resumed_equals_an_uninterrupted_one(
    tmp_path, monkeypatch, strategy, name, k, sig, match, where
):
    # Dropout makes the run depend on the torch RNG, which the checkpoint must restore; momentum and
    # the pre-training lr decay at epoch 1 depend on the optimizer's and the scheduler's state.
    split, cfg = _split(), _cfg()
    full = _model(dropout=0.3)
    torch.manual_seed(7)
    want = train(full, split, cfg, strategy, progress=False)
    ckpt = tmp_path / "stage.pt"
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    signal_on_call(train_mod, name, k, sig, setattr_=monkeypatch.setattr)
    cut = _model(dropout=0.3)
    torch.manual_seed(7)
    with pytest.raises(TrainingInterrupted, match=match) as err:
        train(cut, split, cfg, strategy, checkpoint=ckpt, key="k", progress=False)
    monkeypatch.undo()
    assert err.value.signal == sig and str(ckpt) in str(err.value)
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers  # put back
    state = torch.load(ckpt, weights_only=True)  # a plain file: no pickled objects
    steps = 3 if strategy is None else 4
    assert (state["epoch"], state["step"]) == where and len(state["history"]["ce"]) == where[
        0
    ] * steps + where[1]
    # another RNG state and other initial weights: all must come from the checkpoint
    torch.manual_seed(12345)
    resumed = _model(seed=99, dropout=0.3)
    got = train(
        resumed, split, cfg, strategy, checkpoint=ckpt, resume=True, key="k", progress=False
    )
    assert got["history"] == want["history"]  # every per-step loss and validation AUROC
    _same_state(resumed.state_dict(), full.state_dict())
    if strategy is not None:
        _same_state(got["best"], want["best"])


@pytest.mark.parametrize(
    "key, strategy, match",
    [
        (
            "other",
            "concat",
            r"'fine-tuning \(concat\)'.*\bk\b.*'fine-tuning \(concat\)'.*\bother\b.*--fresh",
        ),
        (
            "k",
            "separate",
            r"'fine-tuning \(concat\)'.*\bk\b.*'fine-tuning \(separate\)'.*--fresh",
        ),
    ],
)
def test_resuming_with_other_settings_is_refused(tmp_path, key, strategy, match):
    ckpt, split, cfg = tmp_path / "stage.pt", _split(), _cfg(finetune_epochs=1, steps_per_epoch=1)
    train(_model(), split, cfg, "concat", checkpoint=ckpt, key="k", progress=False)
    before = ckpt.read_bytes()
    with pytest.raises(ConfigError, match=match) as err:
        train(_model(), split, cfg, strategy, checkpoint=ckpt, resume=True, key=key, progress=False)
    assert err.value.field == "resume" and ckpt.read_bytes() == before


def test_three_sgd_optimizers_as_the_official_solver_equal_trains_one():
    # official solver.py: one SGD each for G, F1, F2 (same settings), zeroed and stepped together
    split = _split(torch.float64)
    model = _model().double()
    cfg = _cfg(finetune_epochs=1, steps_per_epoch=1, finetune_weight_decay=0.01)
    i_sup, i_unsup = _perm(48, 0, LABELED, 0)[:8], _perm(40, 0, UNLABELED, 0)[:8]
    xs, ys, xu = split.x_sup[i_sup], split.y_sup[i_sup], split.x_unsup[i_unsup]
    net = copy.deepcopy(model).train()
    opts = [
        torch.optim.SGD(
            m.parameters(),
            lr=cfg.finetune_lr,
            momentum=cfg.finetune_momentum,
            weight_decay=cfg.finetune_weight_decay,
        )
        for m in (net.G, net.F1, net.F2)
    ]

    def step(loss):
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()

    feat = net.G(xs)
    step(F.cross_entropy(net.F1(feat), ys) + F.cross_entropy(net.F2(feat.detach()), ys))  # Step A
    (l1s, l2s), (l1u, l2u) = net(xs), net(xu)  # Step B, separate forwards
    step(
        F.cross_entropy(l1s, ys)
        + F.cross_entropy(l2s, ys)
        + torch.clamp(cfg.margin - (_entropy(l1u) - _entropy(l2u)).mean(), min=0)
    )
    got = copy.deepcopy(model)
    train(got, split, cfg, "separate", progress=False)  # one optimizer over every parameter
    for (k, a), b in zip(net.state_dict().items(), got.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=k)
    assert (
        max((a - b).abs().max().item() for a, b in zip(net.parameters(), model.parameters())) > 1e-3
    )


@pytest.mark.parametrize("strategy, calls", [(None, 2 * 3), ("separate", 0)])
def test_crop_flip_augments_pre_training_batches_only(monkeypatch, strategy, calls):
    seen, real = [], train_mod.crop_flip

    def spy(x, generator, pad, fill, share):
        seen.append((tuple(x.shape), pad, float(fill.flatten()[0]), share))
        return real(x, generator, pad, fill, share)

    monkeypatch.setattr(train_mod, "crop_flip", spy)
    cfg = _cfg(pretrain_crop_flip=True, finetune_epochs=1, steps_per_epoch=2)
    train(_model(), _split(), cfg, strategy, progress=False)
    # 2 epochs x 48 // 16 pre-training steps, each batch (16, 1, 8, 8) padded by 4 with the
    # normalised black of Fashion-MNIST, one process's share; fine-tuning batches untouched
    assert len(seen) == calls
    assert all(s == ((16, 1, 8, 8), 4, pytest.approx(-0.2860 / 0.3530), (0, 1)) for s in seen)
