"""The command line: flags map one-to-one onto config fields; errors exit 2 with a message."""
import dataclasses

import torch

import pytest

from mcd_helpers.__main__ import build_parser, config_from_args, main
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.presets import PRESETS


def _cfg(*flags: str) -> MCDConfig:
    return config_from_args(build_parser().parse_args(["reproduce", "--out", "x", *flags]))


def test_every_config_field_has_a_flag():
    rep = build_parser()._subparsers._group_actions[0].choices["reproduce"]
    dests = {a.dest for a in rep._actions}
    assert {f.name for f in dataclasses.fields(MCDConfig)} - {"extra"} <= dests


def test_fast_path_is_off_by_default_and_on_with_its_flags():
    cfg = _cfg()
    assert (cfg.amp, cfg.channels_last, cfg.compile, cfg.data_on_device, cfg.device) == \
        ("none", False, False, False, "cpu")
    cfg = _cfg("--amp", "bf16", "--channels-last", "--compile", "--data-on-device", "--device", "cuda")
    assert (cfg.amp, cfg.channels_last, cfg.compile, cfg.data_on_device, cfg.device) == \
        ("bf16", True, True, True, "cuda")
    assert _cfg("--compile", "--no-compile").compile is False  # the last switch wins


def test_flags_override_the_preset_and_parse_their_types():
    cfg = _cfg("--checkpoint-every", "7", "--train-subset", "500", "--ood-sets", "digits,gaussian",
               "--finetune-lr", "0.01", "--pretrain-milestones", "1,2")
    assert cfg.checkpoint_every == 7 and cfg.train_subset == 500
    assert cfg.ood_sets == ("digits", "gaussian") and cfg.pretrain_milestones == (1, 2)
    assert cfg.finetune_lr == 0.01
    assert cfg.steps_per_epoch == PRESETS["quick"].steps_per_epoch  # untouched: the preset's value


def test_resume_and_fresh_exclude_each_other(capsys, tmp_path, monkeypatch):
    import mcd_helpers.experiments.run as reproduce

    monkeypatch.setattr("mcd_helpers.experiments.pipeline.load_id", lambda *a, **k: pytest.fail("data loaded although the flags conflict"))
    args = build_parser().parse_args(["reproduce", "--out", "x", "--resume"])
    assert (args.resume, args.fresh, args.retrain) == (True, False, False)
    assert main(["reproduce", "--out", str(tmp_path / "o"), "--resume", "--fresh"]) == 2
    assert "--fresh: --resume continues the checkpoints in --out and --fresh deletes them" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--amp", "fp16"], "amp must be one of ('none', 'bf16'), got 'fp16'"),
    (["--checkpoint-every", "-1"], "checkpoint_every must be >= 0"),
    (["--preset", "nope"], "unknown preset 'nope'"),
])
def test_bad_values_exit_2_with_the_reason(flags, message, capsys, tmp_path):
    assert main(["reproduce", "--out", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


def test_out_is_required(capsys):
    assert main(["reproduce"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


def test_list_presets(capsys):
    assert main(["reproduce", "--list-presets"]) == 0
    assert "quick:" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--n-val", "-1"], "n_val must be >= 1"),
    (["--finetune-epochs", "0"], "finetune_epochs must be >= 1"),
    (["--eval-batch-size", "0"], "eval_batch_size must be >= 1"),
    (["--seed", "-1"], "seed must be in"),
    (["--margin", "inf"], "margin must be a finite"),
    (["--finetune-lr", "-0.1"], "finetune_lr must be a positive"),
    (["--model", "densenet_bc_100", "--norm", "group"], "applies to small_cnn only"),
    (["--device", "tpu"], "device must be"),
])
def test_settings_that_cannot_work_are_refused_before_any_work(flags, message, capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["reproduce", "--preset", "quick", "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


def test_spaces_after_commas_in_list_flags_are_ignored():
    args = build_parser().parse_args(["reproduce", "--preset", "quick", "--ood-sets", "gaussian, uniform"])
    assert config_from_args(args).ood_sets == ("gaussian", "uniform")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_is_an_error_before_loading_data(capsys, tmp_path, monkeypatch):
    import mcd_helpers.experiments.run as reproduce

    monkeypatch.setattr("mcd_helpers.experiments.pipeline.load_id", lambda *a, **k: pytest.fail("data loaded before the device check"))
    assert main(["reproduce", "--preset", "quick", "--out", str(tmp_path / "o"), "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_an_unknown_ood_set_is_refused_before_any_work(capsys, tmp_path, monkeypatch):
    import mcd_helpers.experiments.run as reproduce

    monkeypatch.setattr("mcd_helpers.experiments.pipeline.load_id", lambda *a, **k: pytest.fail("data loaded before the check"))
    assert main(["reproduce", "--preset", "quick", "--out", str(tmp_path / "o"), "--ood-sets", "digits, foo"]) == 2
    assert "unknown OOD set(s) ['foo']" in capsys.readouterr().err
