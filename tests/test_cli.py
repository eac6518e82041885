"""The command line: a flag per config field, the preset's values unless a flag is given, one
message and one exit code per error, every setting that cannot work refused before any data is
loaded."""

import dataclasses

import pytest
import torch

from mcd_helpers.experiments.cli import build_parser, config_from_args, main
from mcd_helpers.experiments.config import PRESETS, MCDConfig


def cfg_of(*flags: str) -> MCDConfig:
    return config_from_args(build_parser().parse_args(["reproduce", "--out", "x", *flags]))


@pytest.fixture
def no_data(monkeypatch):
    """Any attempt to load data fails the test: what is checked must be checked before."""
    monkeypatch.setattr(
        "mcd_helpers.experiments.stages.load_id",
        lambda *a, **k: pytest.fail("data loaded before the check"),
    )


def test_every_config_field_has_a_flag_whose_help_is_its_comment():
    rep = build_parser()._subparsers._group_actions[0].choices["reproduce"]
    actions = {a.dest: a for a in rep._actions}
    assert {f.name for f in dataclasses.fields(MCDConfig)} <= set(actions)
    # the field's comment in MCDConfig's source
    assert "nats, official default" in actions["margin"].help
    assert actions["compile"].help.startswith("compile: torch.compile")


def test_flags_override_the_preset_parse_their_types_and_switch():
    cfg = cfg_of(
        "--checkpoint-every",
        "7",
        "--ood-sets",
        "digits, gaussian",
        "--finetune-lr",
        "0.01",
        "--pretrain-milestones",
        "1,2",
        "--channels-last",
        "--odin-epsilons",
        "0,0.5",
    )
    assert (cfg.checkpoint_every, cfg.ood_sets, cfg.finetune_lr) == (
        7,
        ("digits", "gaussian"),
        0.01,
    )
    assert (cfg.pretrain_milestones, cfg.channels_last, cfg.odin_epsilons) == (
        (1, 2),
        True,
        (0.0, 0.5),
    )
    # untouched: the preset's value
    assert cfg.steps_per_epoch == PRESETS["quick"].steps_per_epoch == 150
    assert cfg_of("--compile", "--no-compile").compile is False  # the last switch wins


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--amp", "fp16"], ["--amp:", "'fp16'"]),
        (["--checkpoint-every", "-1"], ["--checkpoint-every:", "got -1"]),
        (["--margin", "inf"], ["--margin:", "got inf"]),
        (["--finetune-lr", "-0.1"], ["--finetune-lr:", "got -0.1"]),
        (["--model", "densenet_bc_100", "--norm", "group"], ["--norm:", "norm='group'"]),
        (["--strategies", "split-bn", "--norm", "none"], ["--strategies:", "norm='none'"]),
        (["--sync-bn"], ["--sync-bn:", "device 'cpu'"]),
        (["--ood-sets", "digits, foo"], ["--ood-sets:", "'foo'"]),
        (["--protocol", "disjoint"], ["--protocol:", "'disjoint'"]),
        (
            ["--class-split", "a", "--protocol", "disjoint", "--ood-sets", "digits"],
            ["--ood-sets:", "'digits'"],
        ),
        (["--preset", "nope"], ["error:", "'nope'"]),
        (["--resume", "--fresh"], ["--fresh:", "--resume"]),
    ],
)
def test_settings_that_cannot_work_exit_2_before_any_work(flags, named, capsys, tmp_path, no_data):
    out = tmp_path / "out"
    assert main(["reproduce", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert all(part in err for part in named), err
    assert not out.exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_before_loading_data(capsys, tmp_path, no_data):
    assert main(["reproduce", "--out", str(tmp_path / "o"), "--device", "cuda"]) == 2
    assert "--device: device='cuda'" in capsys.readouterr().err
    # not a device name at all
    assert main(["reproduce", "--out", str(tmp_path / "o"), "--device", "gpu"]) == 2
    assert "--device: device='gpu'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["reproduce", "benchmark"])
def test_out_is_required_and_presets_are_listed(command, capsys):
    assert main([command]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    assert main([command, "--list-presets"]) == 0
    listed = capsys.readouterr().out
    assert (
        ("quick: " in listed and "paper-cifar10-wrn: " in listed)
        if command == "reproduce"
        else (
            "near-ood-quick: split a, every protocol" in listed and "seeds 5 (at most 5)" in listed
        )
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seeds", "1"], "--seeds: seeds must be a count or a range A-B of 2 to 5 seeds"),
        (["--seeds", "3-9"], "got '3-9'"),
        (["--protocols", "transductive,nope"], "--protocols: protocols ['transductive', 'nope']"),
        (["--class-splits", "a,012345/6789"], "--class-splits: class splits ['a', '012345/6789']"),
        (["--preset", "nope"], "--preset: unknown benchmark preset 'nope'"),
    ],
)
def test_the_benchmark_refuses_bad_grids_before_any_work(flags, message, capsys, tmp_path, no_data):
    out = tmp_path / "out"
    assert main(["benchmark", "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug, not a user's error")

    monkeypatch.setattr("mcd_helpers.experiments.reproduce.run_reproduction", broken)
    with pytest.raises(ZeroDivisionError):
        main(["reproduce", "--out", str(tmp_path / "o")])


def _help_of(argv: list[str]) -> dict:
    rep = build_parser(argv)._subparsers._group_actions[0].choices["reproduce"]
    return {a.dest: a.help for a in rep._actions}


@pytest.mark.parametrize("preset", ["quick", "paper-cifar10-densenet"])
def test_help_shows_the_named_presets_own_defaults(preset):
    # the help is read from the parser built for "--preset NAME --help"; the values come from
    # PRESETS itself
    shown = _help_of(["reproduce", "--preset", preset, "--help"])
    p = PRESETS[preset]
    assert shown["finetune_lr"].endswith(f"({preset}: {p.finetune_lr})")
    assert shown["model"].endswith(f"({preset}: {p.model})")
    assert shown["ood_sets"].endswith(f"({preset}: {','.join(p.ood_sets)})")
    # quick's, not the dataclass's 0.01
    assert _help_of(["reproduce", "--help"])["finetune_lr"].endswith("(quick: 0.005)")
    assert MCDConfig().finetune_lr == 0.01


def test_every_flag_has_help_and_strategies_lists_every_strategy():
    from mcd_helpers.strategies import STRATEGIES

    parser = build_parser([])
    for sub in parser._subparsers._group_actions[0].choices.values():
        assert all(a.help for a in sub._actions), [a.dest for a in sub._actions if not a.help]
    assert all(s in _help_of([])["strategies"] for s in STRATEGIES) and len(STRATEGIES) == 10
    bench = {
        a.dest: a.help for a in parser._subparsers._group_actions[0].choices["benchmark"]._actions
    }
    from mcd_helpers.experiments.config import SELECTIONS
    from mcd_helpers.splits import CLASS_SPLITS, PROTOCOLS

    for dest, values in (
        ("strategies", STRATEGIES),
        ("protocols", PROTOCOLS),
        ("selections", SELECTIONS),
        ("class_splits", tuple(CLASS_SPLITS)),
    ):
        assert "of " + ",".join(values) in bench[dest], (dest, bench[dest])


def test_config_reruns_a_run_and_flags_override_it(tmp_path):
    ran = dataclasses.replace(PRESETS["quick"], margin=0.7, ood_sets=("digits",), seed=3)
    import json

    (tmp_path / "config.json").write_text(json.dumps(ran.to_dict()))  # what reproduce writes
    assert cfg_of("--config", str(tmp_path / "config.json")) == ran
    assert cfg_of("--config", str(tmp_path / "config.json"), "--seed", "4") == dataclasses.replace(
        ran, seed=4
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "FileNotFoundError"),
        ("not json", "JSONDecodeError"),
        ('{"margin": 1.0, "lr": 3}', "unknown fields ['lr']"),
        ("[1, 2]", "a JSON list, not an object"),
    ],
)
def test_a_bad_config_file_is_refused_with_its_path(tmp_path, capsys, text, message):
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    assert main(["reproduce", "--out", str(tmp_path / "o"), "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err and "not a run's config.json" in err
    assert not (tmp_path / "o").exists()


def test_benchmark_refuses_a_device_pytorch_does_not_see(tmp_path, capsys, no_data):
    device = "cuda" if not torch.cuda.is_available() else "cuda:99"
    assert (
        main(
            [
                "benchmark",
                "--preset",
                "near-ood-quick",
                "--out",
                str(tmp_path / "b"),
                "--device",
                device,
            ]
        )
        == 2
    )
    assert "PyTorch sees no such device" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("terminal", [True, False, None])
def test_progress_bars_on_a_terminal_only(terminal, monkeypatch, tmp_path):
    """A redirected log (stderr not a terminal) gets no progress bars, nor does a stream without
    ``isatty`` (a wrapper; None: pythonw's closed stderr); --quiet none anywhere."""
    import io
    import sys

    seen = []

    def fake_run(cfg, out, **how):
        seen.append(how["progress"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text("table")

    monkeypatch.setattr("mcd_helpers.experiments.reproduce.run_reproduction", fake_run)
    stderr = (
        None
        if terminal is None
        else type("Err", (io.StringIO,), {"isatty": lambda self: terminal})()
    )
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(["reproduce", "--out", str(tmp_path / "o")]) == 0
    assert main(["reproduce", "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert seen == [bool(terminal), False]
