"""mcd_helpers.config (MCDConfig's checks, the presets) and mcd_helpers.errors (exit codes,
pickling)."""

import dataclasses
import pickle
import re
import signal
from pathlib import Path

import pytest
import torch

from mcd_helpers.data import DataNotFoundError
from mcd_helpers.errors import ConfigError, TrainingInterrupted
from mcd_helpers.experiments.cache import cache_key
from mcd_helpers.experiments.cli import exit_code
from mcd_helpers.experiments.config import (
    PRESETS,
    PRETRAIN_FIELDS,
    MCDConfig,
    get_preset,
    native_bf16,
)

ODIN_FOLDERS = ("Imagenet", "Imagenet_resize", "LSUN", "LSUN_resize", "iSUN")


def refused(field, match, **kw):
    with pytest.raises(ConfigError, match=match) as err:
        MCDConfig(**kw)
    assert err.value.field == field and err.value.flag == "--" + field.replace("_", "-")


def test_the_defaults_are_valid_and_tuple_fields_become_tuples():
    cfg = MCDConfig(
        ood_sets=["digits"],
        strategies=["concat"],
        pretrain_milestones=[1, 2],
        odin_temperatures=[1],
        odin_epsilons=[0],
    )
    assert (
        cfg.ood_sets,
        cfg.strategies,
        cfg.pretrain_milestones,
        cfg.odin_temperatures,
        cfg.odin_epsilons,
    ) == (("digits",), ("concat",), (1, 2), (1,), (0,))
    assert MCDConfig().to_dict()["finetune_lr"] == 0.01 and len(MCDConfig().to_dict()) == len(
        dataclasses.fields(MCDConfig)
    )


@pytest.mark.parametrize(
    "field, value, valid",
    [
        ("id_dataset", "svhn", "fashion_mnist, cifar10, cifar100"),
        ("model", "resnet18", "small_cnn, resnet_20, densenet_bc_100, wrn_28_10"),
        ("norm", "layer", "batch, group, none"),
        ("schedule", "step_a", "official, step_b"),
        ("protocol", "inductive", "transductive, disjoint, unseen-ood"),
        ("selection", "best", "ood-labels, last-epoch"),
        ("amp", "fp16", "none, bf16, auto"),
    ],
)
def test_a_choice_outside_its_list(field, value, valid):
    refused(field, f"{re.escape(valid)}.*'{value}'", **{field: value})


def test_amp_auto_is_bf16_where_the_device_has_native_bf16_and_the_cache_keys_hold_what_trains(
    monkeypatch,
):
    flags = open("/proc/cpuinfo").read().split() if Path("/proc/cpuinfo").exists() else None
    if flags is not None:  # Linux says it independently of torch
        assert native_bf16("cpu") == bool({"avx512_bf16", "amx_bf16"} & set(flags))
    for native in (True, False):
        monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr("torch.cpu._is_amx_tile_supported", lambda: False)
        auto, fixed = MCDConfig(amp="auto"), MCDConfig(amp="bf16" if native else "none")
        assert auto.resolved_amp() == fixed.resolved_amp() == fixed.amp
        assert cache_key(auto, "pretrain") == cache_key(fixed, "pretrain")  # the key of what trains
        assert cache_key(auto, "finetune") == cache_key(fixed, "finetune")
        assert native_bf16(torch.device("cpu")) == native  # a torch.device as well as a string
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    # a preset's "auto" is resolved for the device given later (the CPU's bf16 is not the GPU's)
    assert dataclasses.replace(get_preset("quick"), device="cuda").resolved_amp() == "none"
    assert (
        not native_bf16("cuda") and not native_bf16("not a device") and native_bf16("cpu") is False
    )


AT_LEAST = {
    "ood_size": 1,
    "n_val": 1,
    "train_subset": 0,
    "test_subset": 0,
    "n_holdout": 1,
    "pretrain_epochs": 1,
    "pretrain_batch_size": 1,
    "finetune_epochs": 1,
    "steps_per_epoch": 0,
    "batch_size_sup": 1,
    "batch_size_unsup": 1,
    "eval_batch_size": 1,
    "num_threads": 0,
    "checkpoint_every": 0,
    "seed": 0,
    "split_seed": 0,
    "margin": 0.0,
    "pretrain_momentum": 0.0,
    "finetune_momentum": 0.0,
    "pretrain_weight_decay": 0.0,
    "finetune_weight_decay": 0.0,
}
BELOW = [(f, low - 1 if isinstance(low, int) else -0.01, low) for f, low in AT_LEAST.items()]
NOT_NUMBERS = [
    ("n_val", True, 1),
    ("batch_size_sup", "64", 1),
    ("margin", float("nan"), 0.0),
    ("finetune_weight_decay", float("inf"), 0.0),
    ("seed", None, 0),
]


@pytest.mark.parametrize("field, value, low", BELOW + NOT_NUMBERS)
def test_a_number_below_its_bound_or_not_a_number(field, value, low):
    refused(field, re.escape(f"got {value!r}"), **{field: value})


@pytest.mark.parametrize(
    "kw, field, named",
    [
        (dict(pretrain_lr=0.0), "pretrain_lr", "got 0.0"),
        (dict(pretrain_lr="0.1"), "pretrain_lr", "got '0.1'"),
        (dict(finetune_lr=-0.1), "finetune_lr", "got -0.1"),
        (dict(finetune_lr=float("inf")), "finetune_lr", "got inf"),
        (dict(seed=2**32), "seed", "got 4294967296"),
        (dict(split_seed=2**32), "split_seed", "got 4294967296"),
        (dict(pretrain_momentum=1.0), "pretrain_momentum", "got 1.0"),
        (dict(finetune_momentum=1.0), "finetune_momentum", "got 1.0"),
        (dict(margin=1e39), "margin", "got 1e+39"),
        (dict(strategies=()), "strategies", "got ()"),
        (dict(strategies=("separate", "mixed")), "strategies", "'mixed'"),
        (dict(norm="group", strategies=("split-bn",)), "strategies", "norm='group'"),
        (dict(norm="none", strategies=("recalibrate",)), "strategies", "norm='none'"),
        (dict(model="densenet_bc_100", norm="group"), "norm", "norm='group'"),
        (dict(sync_bn=True), "sync_bn", "device 'cpu'"),
        (dict(pretrain_milestones=(2, -1)), "pretrain_milestones", ">= 0"),
        (dict(ood_sets=()), "ood_sets", "OOD set"),
        (dict(id_dataset="cifar10", class_split="a"), "class_split", "'cifar10'"),
        (dict(protocol="disjoint"), "protocol", "'disjoint'"),
        (dict(odin_temperatures=()), "odin_temperatures", "got ()"),
        (dict(odin_temperatures=(1.0, 0.0)), "odin_temperatures", "got (1.0, 0.0)"),
        (dict(odin_temperatures=(1000.0, float("inf"))), "odin_temperatures", "got (1000.0, inf)"),
        (dict(odin_epsilons=()), "odin_epsilons", "got ()"),
        (dict(odin_epsilons=(0.0, -0.001)), "odin_epsilons", "got (0.0, -0.001)"),
        (dict(odin_epsilons=(0.0, float("nan"))), "odin_epsilons", "got (0.0, nan)"),
        (dict(class_split="01a/23"), "class_split", "'01a/23'"),
        (dict(class_split="012/23"), "class_split", "'012/23'"),
        (dict(bn_momentum=1.5), "bn_momentum", "got 1.5"),
        (dict(bn_momentum=-0.1), "bn_momentum", "got -0.1"),
        (dict(class_split="a", unlabeled_ood_fraction=0.5), "unlabeled_ood_fraction", "got 0.5"),
    ],
)
def test_settings_that_cannot_work(kw, field, named):
    refused(field, re.escape(named), **kw)


@pytest.mark.parametrize(
    "cfg, oods",
    [
        (MCDConfig(), ("digits", "photo_crops", "gaussian", "uniform", "mnist")),
        (MCDConfig(id_dataset="cifar100"), ODIN_FOLDERS + ("gaussian",)),
        (MCDConfig(class_split="a", protocol="disjoint"), ("heldout",)),
        (MCDConfig(class_split="a"), ("heldout", "digits")),  # transductive: both kinds
    ],
)
def test_check_ood_set_takes_the_sets_of_the_id_set_and_protocol(cfg, oods):
    for ood in oods:
        cfg.check_ood_set(ood)


@pytest.mark.parametrize(
    "cfg, ood, named",
    [
        (MCDConfig(), "Imagenet", "'Imagenet'"),
        (MCDConfig(), "heldout", "'heldout'"),  # no class_split: no held-out classes
        (MCDConfig(id_dataset="cifar10"), "digits", "'digits'"),
        (MCDConfig(class_split="a", protocol="unseen-ood"), "gaussian", "'unseen-ood'"),
    ],
)
def test_check_ood_set_refuses_a_set_the_config_cannot_run(cfg, ood, named):
    with pytest.raises(ConfigError, match=named) as err:
        cfg.check_ood_set(ood)
    assert err.value.field == "ood_sets"


# ---- presets ------------------------------------------------------------------------------------


def pretraining(cfg):
    return {f: getattr(cfg, f) for f in PRETRAIN_FIELDS}


@pytest.mark.parametrize(
    "name",
    [
        "paper-cifar10-densenet",
        "paper-cifar10-wrn",
        "paper-cifar100-densenet",
        "paper-cifar100-wrn",
    ],
)
def test_paper_presets(name):
    cfg, (_, id_set, net) = get_preset(name), name.split("-")
    assert (cfg.id_dataset, cfg.model) == (
        id_set,
        {"densenet": "densenet_bc_100", "wrn": "wrn_28_10"}[net],
    )
    assert cfg.ood_sets == ODIN_FOLDERS + ("gaussian", "uniform")
    # fine-tuning as the authors' solver.py: Step A then Step B, SGD lr 0.01 constant, 10 epochs,
    # 128 + 128
    assert (cfg.schedule, cfg.finetune_lr, cfg.finetune_momentum, cfg.finetune_weight_decay) == (
        "official",
        0.01,
        0.9,
        1e-4,
    )
    assert (cfg.finetune_epochs, cfg.steps_per_epoch, cfg.batch_size_sup, cfg.batch_size_unsup) == (
        10,
        0,
        128,
        128,
    )
    assert (cfg.margin, cfg.n_val, cfg.split_seed, cfg.strategies) == (1.2, 1000, 3, ("separate",))
    # pre-training as the unofficial reproduction: 300 epochs, SGD 0.1, lr x 0.1 at 150 and 225
    assert (
        cfg.pretrain_epochs,
        cfg.pretrain_lr,
        cfg.pretrain_milestones,
        cfg.pretrain_momentum,
    ) == (300, 0.1, (150, 225), 0.9)
    assert cfg.device == "cuda" and (cfg.train_subset, cfg.test_subset) == (0, 0)
    # the declared pre-training recipe: crops and flips (the unofficial reproduction's) at batch 128
    assert (cfg.pretrain_crop_flip, cfg.pretrain_batch_size) == (True, 128)
    assert not get_preset("quick").pretrain_crop_flip  # the CPU presets keep their networks


@pytest.mark.parametrize(
    "name, base",
    [("quick-step-b", "quick"), ("unofficial-schedule-cifar10-densenet", "paper-cifar10-densenet")],
)
def test_step_b_presets_fine_tune_as_the_blog_on_the_same_pretrained_network(name, base):
    cfg = get_preset(name)
    assert (
        cfg.schedule,
        cfg.finetune_lr,
        cfg.finetune_weight_decay,
        cfg.batch_size_sup,
        cfg.batch_size_unsup,
    ) == ("step_b", 0.001, 5e-4, 64, 64)
    assert pretraining(cfg) == pretraining(get_preset(base))


def test_cpu_presets():
    q = get_preset("quick")
    assert (
        q.id_dataset,
        q.model,
        q.norm,
        q.pretrain_epochs,
        q.pretrain_milestones,
        q.finetune_epochs,
        q.steps_per_epoch,
        q.finetune_lr,
        q.schedule,
    ) == ("fashion_mnist", "small_cnn", "batch", 3, (2,), 1, 150, 0.005, "official")
    assert q.channels_last and q.amp == "auto"  # the fastest measured CPU settings
    assert q.resolved_amp() == ("bf16" if native_bf16("cpu") else "none")
    nb = get_preset("notebook")
    assert pretraining(nb) == pretraining(q) and (nb.finetune_epochs, nb.strategies) == (
        3,
        ("separate",),
    )
    nq = get_preset("notebook-quick")
    assert (
        nq.train_subset,
        nq.test_subset,
        nq.n_val,
        nq.ood_size,
        nq.pretrain_epochs,
        nq.steps_per_epoch,
        nq.finetune_epochs,
        nq.finetune_lr,
        nq.batch_size_sup,
        nq.batch_size_unsup,
    ) == (15_000, 1500, 500, 1000, 2, 30, 3, 0.005, 64, 64)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_decays_inside_pretraining_and_leaves_test_images(name):
    cfg = PRESETS[name]
    assert all(0 < m < cfg.pretrain_epochs for m in cfg.pretrain_milestones)
    assert cfg.n_val < (cfg.test_subset or 10_000) and cfg.n_val < cfg.ood_size


def test_get_preset_copies_and_overrides():
    cfg = get_preset("paper-cifar10-densenet", finetune_lr=0.1, seed=4)
    assert (cfg.finetune_lr, cfg.seed) == (0.1, 4) and PRESETS[
        "paper-cifar10-densenet"
    ].finetune_lr == 0.01
    with pytest.raises(ConfigError, match=r"finetune_lr.*\b0\.0\b"):
        get_preset("quick", finetune_lr=0.0)  # overrides are checked too
    with pytest.raises(
        KeyError,
        match="'paper'.*quick, quick-step-b, notebook, notebook-quick, paper-cifar10-densenet",
    ):
        get_preset("paper")
    with pytest.raises(TypeError, match="learning_rate"):
        get_preset("quick", learning_rate=0.1)


# ---- errors.py -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "err, code",
    [
        (TrainingInterrupted("stop", signal.SIGTERM), 143),
        (TrainingInterrupted("stop", signal.SIGINT), 130),
        (TrainingInterrupted("stop"), 143),
        (KeyboardInterrupt(), 130),
        (ConfigError("n_val", "too large"), 2),
        (ValueError("bad"), 2),
        (KeyError("x"), 2),
        (DataNotFoundError("missing"), 2),
        (FileNotFoundError("missing"), 2),
        (PermissionError("read-only"), 2),
        (RuntimeError("broken checkpoint"), 1),
        (FloatingPointError("diverged"), 1),
        (OSError(28, "disk full"), 1),
    ],
)
def test_exit_code(err, code):
    assert exit_code(err) == code


def test_errors_pickle_with_their_fields():  # sent from rank 0 to the other ranks
    c = pickle.loads(pickle.dumps(ConfigError("batch_size_sup", "too large")))
    assert (type(c), c.field, c.flag, str(c)) == (
        ConfigError,
        "batch_size_sup",
        "--batch-size-sup",
        "too large",
    )
    t = pickle.loads(pickle.dumps(TrainingInterrupted("stopped", signal.SIGINT)))
    assert (type(t), t.signal, str(t), exit_code(t)) == (
        TrainingInterrupted,
        signal.SIGINT,
        "stopped",
        130,
    )


def test_sync_bn_is_refused_with_the_detached_statistics_strategies():
    # SyncBatchNorm would replace the detached layers by ordinary ones, silently
    with pytest.raises(ConfigError, match="--sync-bn would turn the .-detached") as err:
        MCDConfig(strategies=("separate-detached",), sync_bn=True, device="cuda")
    assert err.value.field == "sync_bn"
