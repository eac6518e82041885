"""mcd_helpers.experiments.stages: the split, the cached pre-trained and fine-tuned networks, model
selection, and the strategies that change BatchNorm's statistics (split-bn, recalibrate)."""

import copy
import dataclasses

import pytest
import torch
from pipeline_setup import LAST, TINY, history_of

from mcd_helpers.data import DEBIAN_FMNIST_DIR, cache_dir, load_ood
from mcd_helpers.errors import ConfigError
from mcd_helpers.experiments import stages
from mcd_helpers.experiments.cache import cache_key
from mcd_helpers.experiments.stages import (
    RunOptions,
    finetuned,
    make_split,
    pretrained,
    selected_epoch,
)
from mcd_helpers.norms import PerSourceBatchNorm
from mcd_helpers.splits import CLASS_SPLITS

needs_fmnist = pytest.mark.skipif(
    not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed"
)
pytestmark = needs_fmnist
QUIET = RunOptions(progress=False, log=None)


def _nearest(x, pool):
    """Each image's distance to the nearest image of ``pool`` (0: it is one of them)."""
    return (
        torch.cdist(x.flatten(1), pool.flatten(1), compute_mode="donot_use_mm_for_euclid_dist")
        .min(1)
        .values
    )


# ---- make_split ----------------------------------------------------------------------------------


def test_a_far_set_with_a_class_split_keeps_the_id_classes_relabelled(data):
    ids = CLASS_SPLITS["b"][0]  # (0, 2, 3, 5, 7, 9): 7 -> 4, 9 -> 5
    split = make_split(dataclasses.replace(TINY, class_split="b"), data, "gaussian")
    keep = torch.isin(data.y_train, torch.tensor(ids))
    assert torch.equal(split.x_sup, data.x_train[keep])
    assert split.y_sup.tolist() == [ids.index(c) for c in data.y_train[keep].tolist()]
    n_id_test = int(torch.isin(data.y_test, torch.tensor(ids)).sum())
    assert (len(split.test_id_x), len(split.test_ood_x)) == (n_id_test - 40, 200 - 40)
    gauss = load_ood("gaussian", 200, TINY.seed)
    assert _nearest(split.test_ood_x, gauss).max() == 0  # every test OOD image is a gaussian one


@pytest.mark.parametrize("protocol", ["transductive", "unseen-ood"])
def test_the_held_out_classes_are_the_test_ood_set_under_each_protocol(data, protocol):
    cfg = dataclasses.replace(TINY, class_split="a", protocol=protocol, n_holdout=100)
    split = make_split(cfg, data, "heldout")
    in_ood = torch.isin(data.y_test, torch.tensor(CLASS_SPLITS["a"][1]))
    n_id_te, n_ood_te = int((~in_ood).sum()), int(in_ood.sum())
    assert (len(split.test_id_x), len(split.test_ood_x)) == (n_id_te - 40, n_ood_te - 40)
    assert split.y_sup.max() == 5 and split.test_id_y.max() == 5
    n_id_tr = int((data.y_train <= 5).sum())
    if protocol == "transductive":
        assert len(split.x_sup) == n_id_tr and len(split.x_unsup) == len(split.test_id_x) + len(
            split.test_ood_x
        )
    # 100 ID training images held out; the unlabeled OOD part from the digits, the test's ID:OOD
    # ratio
    else:
        n_ood = round(100 * n_ood_te / n_id_te)
        assert len(split.x_sup) == n_id_tr - 100 and len(split.x_unsup) == (100 - 40) + (n_ood - 40)
        assert _nearest(split.x_unsup[60:], load_ood("digits")).max() == 0


@pytest.mark.parametrize(
    "cfg, ood, field, named",
    [
        (TINY, "heldout", "ood_sets", "'heldout'"),
        (
            dataclasses.replace(TINY, class_split="a", protocol="disjoint"),
            "gaussian",
            "ood_sets",
            "'gaussian'",
        ),
        (dataclasses.replace(TINY, batch_size_unsup=1000), "gaussian", "batch_size_unsup", "1000"),
    ],
)
def test_make_split_refuses_what_cannot_be_split(data, cfg, ood, field, named):
    with pytest.raises(ConfigError, match=named) as err:
        make_split(cfg, data, ood)
    assert err.value.field == field


# ---- cache keys ----------------------------------------------------------------------------------


def test_a_second_call_loads_the_pretrained_network(run, no_training):
    res, _ = run
    logs = []
    again = pretrained(TINY, res.split, RunOptions(progress=False, log=logs.append))
    assert len(logs) == 1 and "pretrain: loaded from the cache" in logs[0]
    for k, v in res.models["base"].state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_one_cache_file_holds_both_selections_weights(run, no_training):
    res, _ = run
    for cfg, which in ((TINY, "best"), (LAST, "last")):
        model, hist, _ = finetuned(cfg, res.models["base"], res.split, "gaussian", "concat", QUIET)
        assert hist.val_auroc == res.histories["concat"].val_auroc
        key = cache_key(TINY, "finetune", ood="gaussian", strategy="concat")
        saved = torch.load(cache_dir() / "cache" / f"finetune-{key}.pt", weights_only=True)[which]
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), (which, k)


@pytest.mark.parametrize(
    "selection, want", [("ood-labels", [0, 1, 1, 1]), ("last-epoch", [0, 1, 2, 3])]
)
def test_selected_epoch_is_the_first_best_validation_auroc_or_the_last_epoch(selection, want):
    h = history_of([0.5, 0.8, 0.8, 0.7])
    assert [selected_epoch(h, selection, upto) for upto in range(4)] == want
    assert selected_epoch(h, selection) == want[-1]


def test_selected_epoch_refuses_an_epoch_outside_thehistory_of():
    for upto in (2, -1):
        with pytest.raises(ValueError, match=rf"epoch {upto}\b.*\b2\b"):
            selected_epoch(history_of([0.5, 0.8]), "ood-labels", upto)
    # nothing validated
    with pytest.raises(ValueError, match=r"epoch -1\b.*\b0\b"):
        selected_epoch(history_of([]), "last-epoch")


def _snapshot(epoch, h):
    return (
        epoch,
        list(h.ce),
        list(h.dis),
        list(h.gap),
        list(h.step_a),
        list(h.val_auroc),
        h.best_epoch,
    )


def test_on_epoch_is_called_once_per_epoch_live_and_replayed_from_the_cache(run, monkeypatch):
    res, _ = run
    # another fine-tuning: trained here
    cfg = dataclasses.replace(TINY, margin=0.5, finetune_epochs=3)
    live, replay = [], []
    model, hist, seconds = finetuned(
        cfg,
        res.models["base"],
        res.split,
        "gaussian",
        "separate",
        QUIET,
        on_epoch=lambda e, h: live.append(_snapshot(e, h)),
    )
    assert [s[0] for s in live] == [0, 1, 2]
    # the history up to that epoch; the epoch kept so far
    for e, ce, dis, gap, step_a, val, best in live:
        assert [len(v) for v in (ce, dis, gap, step_a, val)] == [3 * (e + 1)] * 4 + [e + 1]
        assert best == max(range(e + 1), key=lambda i: (val[i], -i))
    assert live[-1][1:] == _snapshot(0, hist)[1:]
    monkeypatch.setattr(
        stages, "train", lambda *a, **k: pytest.fail("fine-tuned again instead of loading")
    )
    again, hist2, seconds2 = finetuned(
        cfg,
        res.models["base"],
        res.split,
        "gaussian",
        "separate",
        QUIET,
        on_epoch=lambda e, h: replay.append(_snapshot(e, h)),
    )
    assert replay == live and hist2 == hist and seconds2 == seconds
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def _bn_average(model, x, batch_size):
    """Per BatchNorm layer, the mean over batches of ``x`` of its input's batch mean and unbiased
    variance."""
    net, seen, hooks = copy.deepcopy(model).train(), {}, []
    for name, m in net.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            hooks.append(
                m.register_forward_pre_hook(
                    lambda m, inp, name=name: seen.setdefault(name, []).append(
                        (inp[0].mean((0, 2, 3)), inp[0].var((0, 2, 3), unbiased=True))
                    )
                )
            )
    with torch.no_grad():
        for chunk in x.split(batch_size):
            # train mode: each layer normalises with the batch's statistics, whatever its buffers
            net(chunk)
    return {
        n: (torch.stack([m for m, _ in v]).mean(0), torch.stack([s for _, s in v]).mean(0), len(v))
        for n, v in seen.items()
    }


def test_recalibrate_is_separates_run_with_statistics_from_the_labeled_images(run, no_training):
    res, _ = run
    separate = res.models["separate"]  # the last selection's: last-epoch
    recal, hist, _ = finetuned(
        LAST, res.models["base"], res.split, "gaussian", "recalibrate", QUIET
    )
    assert hist.val_auroc == res.histories["separate"].val_auroc
    # 600 images: 19 batches, the last of 24
    want = _bn_average(separate, res.split.x_sup, TINY.batch_size_sup)
    assert len(want) == 3
    rs, ss = recal.state_dict(), separate.state_dict()
    for k, v in ss.items():
        layer, _, buf = k.rpartition(".")
        if layer in want:
            if buf in ("running_mean", "running_var"):
                torch.testing.assert_close(
                    rs[k], want[layer][0 if buf == "running_mean" else 1], rtol=1e-5, atol=1e-6
                )
                # not the separate run's statistics
                assert not torch.allclose(rs[k], v, rtol=1e-3), k
                continue
            if buf == "num_batches_tracked":
                assert int(rs[k]) == want[layer][2] == 19
                continue
        assert torch.equal(rs[k], v), k  # every weight is the separate run's


def test_split_bn_fine_tunes_a_copy_with_statistics_per_source(run):
    res, _ = run
    base = res.models["base"]
    before = copy.deepcopy(base.state_dict())
    model, _, _ = finetuned(LAST, base, res.split, "gaussian", "split-bn", QUIET)
    layers = [m for m in model.modules() if isinstance(m, PerSourceBatchNorm)]
    assert len(layers) == 3 and not any(
        isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()
    )
    # pre-training: 600 // 128 = 4 batches; then 2 epochs x 3 steps, each Step A and Step B's
    # labeled forward on source 0 and Step B's unlabeled forward on source 1
    for m in layers:
        assert m.num_batches_tracked.tolist() == [4 + 2 * 6, 4 + 6]
        assert not torch.allclose(m.running_mean[0], m.running_mean[1])
    for k, v in base.state_dict().items():  # the pre-trained network is not changed
        assert torch.equal(v, before[k]), k


def test_recalibration_images_by_source():
    from mcd_helpers.splits import Split

    x_sup = torch.arange(30.0).view(30, 1, 1, 1)  # labeled images 0..29
    x_unsup = 100 + torch.arange(12.0).view(12, 1, 1, 1)  # unlabeled images 100..111, ID first
    empty = torch.empty(0)
    split = Split(x_sup, empty, x_unsup, *[empty] * 6)
    assert torch.equal(stages.recalibration_images(split, "labeled"), x_sup)
    # the pool is stored ID first: shuffled, so that a batch holds ID and OOD images alike
    pool = stages.recalibration_images(split, "unlabeled", seed=1).flatten()
    assert sorted(pool.tolist()) == list(range(100, 112)) and pool.tolist() != sorted(pool.tolist())
    mixed = stages.recalibration_images(split, "mixture", seed=1).flatten()
    # 2 labeled : 1 unlabeled, as Step A + Step B feed BatchNorm: all 12 unlabeled, 24 labeled
    assert sorted(mixed.tolist()) == list(range(24)) + list(range(100, 112))
    assert (mixed[:12] >= 100).sum() not in (0, 12)  # shuffled: a batch holds both
    # a pool larger than its share: the share is drawn from the whole pool, not its ID head
    small = Split(x_sup[:10], empty, x_unsup, *[empty] * 6)
    mixture = stages.recalibration_images(small, "mixture", 1).flatten().tolist()
    share = sorted(v for v in mixture if v >= 100)
    assert len(share) == 5 and share != list(range(100, 105))
    with pytest.raises(ValueError, match="labeled, unlabeled, mixture.*'test'"):
        stages.recalibration_images(split, "test")
