"""Command line: ``python -m mcd_helpers reproduce`` and ``python -m mcd_helpers benchmark``.

Examples::

    python -m mcd_helpers benchmark --preset near-ood-quick --out runs/near-ood-quick   # CPU, <= 20 minutes
    python -m mcd_helpers benchmark --preset near-ood --out runs/near-ood --seeds 10     # the full preset

    python -m mcd_helpers reproduce --preset quick --out runs/demo     # CPU, about 10 minutes
    python -m mcd_helpers reproduce --preset quick --out runs/demo --resume   # after an interruption
    python -m mcd_helpers reproduce --list-presets
    torchrun --standalone --nproc_per_node=2 -m mcd_helpers reproduce --preset quick --out runs/ddp   # DDP, CPU
    python -m mcd_helpers reproduce --preset quick --out runs/x --strategies concat --margin 0.8
    python -m mcd_helpers reproduce --preset paper-cifar10-densenet --out runs/c10 \
        --amp bf16 --channels-last --compile --data-on-device                 # GPU fast path

Every field of :class:`mcd_helpers.experiments.config.MCDConfig` is a flag (``finetune_lr`` ->
``--finetune-lr``); tuple fields take comma-separated values (``--ood-sets digits,gaussian``),
yes/no fields are switches (``--compile`` / ``--no-compile``). The data root is
``$MCD_DATA_DIR`` (see :mod:`mcd_helpers.data`).

Interrupted runs: checkpoints are written every ``--checkpoint-every`` steps and at every epoch
end; SIGTERM (``kill``, a batch scheduler's time limit) or SIGINT (Ctrl-C) finishes the step,
saves one at once, prints how to resume and exits with 143 (SIGTERM) or 130 (SIGINT); a second
Ctrl-C stops at once. ``--resume`` with the same ``--out`` and settings continues; the results
equal those of an uninterrupted run (exactly on the CPU). A run that finds checkpoints of an
unfinished run in ``--out`` stops unless given ``--resume`` (continue) or ``--fresh`` (delete them,
start over). One run at a time per ``--out`` (``<out>/.lock``).

Exit codes: 0 done; 1 a run error (diverged, unreadable checkpoint, an OOD set failed after
others were written, a full disk); 2 a setting or the environment (bad flag value, data not
found, folder not writable, ``--out`` in use or holding an unfinished run); 130 / 143 interrupted.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from pathlib import Path

from .experiments.config import MCDConfig
from .errors import ConfigError
from .experiments.presets import PRESETS, get_preset

_FIELD_HELP = {
    "id_dataset": "ID data set (Fashion-MNIST on CPU)",
    "ood_sets": "OOD sets, comma-separated: digits, photo_crops, gaussian, uniform, mnist",
    "ood_size": "number of samples in the generated OOD sets (photo_crops, gaussian, uniform)",
    "n_val": "validation samples taken from each of the ID test set and the OOD set",
    "split_seed": "seed of the transductive split's permutation (official code: 3)",
    "model": "network: small_cnn, densenet_bc_100 or wrn_28_10",
    "norm": "normalisation of small_cnn: batch, group or none",
    "pretrain_epochs": "pre-training epochs (CE on both heads)",
    "pretrain_lr": "pre-training SGD learning rate",
    "pretrain_momentum": "pre-training SGD momentum",
    "pretrain_weight_decay": "pre-training weight decay",
    "pretrain_milestones": "epochs at which the pre-training lr is multiplied by 0.1, comma-separated",
    "pretrain_batch_size": "pre-training batch size",
    "schedule": "fine-tuning schedule: official (Step A then Step B) or step_b (Step B only)",
    "strategies": "how Step B feeds the two batches, comma-separated: separate, concat",
    "finetune_epochs": "fine-tuning epochs (model selection by validation AUROC after each)",
    "steps_per_epoch": "cap on fine-tuning iterations per epoch (0 = one pass over the labeled set)",
    "finetune_lr": "fine-tuning SGD learning rate (constant)",
    "finetune_momentum": "fine-tuning SGD momentum",
    "finetune_weight_decay": "fine-tuning weight decay",
    "batch_size_sup": "labeled batch size in fine-tuning",
    "batch_size_unsup": "unlabeled batch size in fine-tuning",
    "margin": "margin m of the discrepancy loss, in nats",
    "seed": "seed of initialisation, shuffling and generated OOD sets",
    "eval_batch_size": "batch size for evaluation",
    "device": "torch device, e.g. cpu or cuda",
    "num_threads": "CPU threads for PyTorch (0 = its default)",
    "train_subset": "use only the first N ID training images (0 = all); for fast tests",
    "test_subset": "use only the first N ID test images, before the transductive split (0 = all); for fast tests",
    "checkpoint_every": "training steps between checkpoints, also written at every epoch end (0 = epoch ends only)",
    "amp": "mixed precision: none or bf16 (bfloat16 autocast; GPU fast path)",
    "channels_last": "channels-last (NHWC) memory format for model and batches (GPU fast path)",
    "compile": "torch.compile the feature extractor G, one graph per batch shape (GPU fast path)",
    "sync_bn": "under torchrun: SyncBatchNorm, BatchNorm statistics over the global batch (GPUs only)",
    "data_on_device": "hold the whole data set on the device and gather batches there (GPU fast path)",
}


def _parse_tuple(kind):
    def parse(text: str):
        return tuple(kind(v.strip()) for v in text.split(",") if v.strip())
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mcd_helpers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("reproduce", help="pre-train, fine-tune with MCD, evaluate, write results",
                         description="Pre-train on the ID set (or reuse the cached network), fine-tune "
                         "one model per OOD set and strategy, evaluate MCD and MSP on the test split, "
                         "write results.json, results.md and PNG plots into --out.")
    rep.add_argument("--preset", default="quick", help=f"named settings: {', '.join(PRESETS)} (default quick)")
    rep.add_argument("--list-presets", action="store_true", help="show the presets and exit")
    rep.add_argument("--out", type=Path, help="output folder (required unless --list-presets)")
    rep.add_argument("--retrain", action="store_true", help="pre-train again even if a cached network exists")
    rep.add_argument("--resume", action="store_true",
                     help="continue an interrupted run in --out from its last checkpoints (finished stages "
                     "are not redone); the settings must be those of the interrupted run")
    rep.add_argument("--fresh", action="store_true",
                     help="delete the checkpoints of an unfinished run in --out and start over (without it, "
                     "a run that finds them stops and asks for --resume or --fresh)")
    rep.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    hints = typing.get_type_hints(MCDConfig)
    for f in dataclasses.fields(MCDConfig):
        if f.name == "extra":
            continue
        hint = hints[f.name]
        flag, text = "--" + f.name.replace("_", "-"), _FIELD_HELP.get(f.name, f.name)
        if hint is bool:  # a switch: --compile / --no-compile
            rep.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, dest=f.name,
                             help=f"{text} (default: from the preset; base {'on' if f.default else 'off'})")
            continue
        if typing.get_origin(hint) is tuple:
            kind, default = _parse_tuple(typing.get_args(hint)[0]), ",".join(map(str, f.default))
        else:
            kind, default = hint, f.default
        rep.add_argument(flag, type=kind, default=None, dest=f.name,
                         help=f"{text} (default: from the preset; base {default})")
    bench = sub.add_parser("benchmark", help="near-OOD benchmark: protocols x strategies x methods over seeds",
                           description="Run a benchmark preset (held-out Fashion-MNIST classes under the "
                           "transductive, disjoint and unseen-ood protocols; MCD strategies and BatchNorm remedies; "
                           "MSP, ODIN, energy) over several seeds; write results.json, scores/, summary.md, "
                           "forest.png and by_protocol.png into --out.")
    bench.add_argument("--preset", default="near-ood-quick", help="benchmark preset (default near-ood-quick); "
                       "see --list-presets")
    bench.add_argument("--list-presets", action="store_true", help="show the benchmark presets and exit")
    bench.add_argument("--out", type=Path, help="output folder (required unless --list-presets)")
    bench.add_argument("--seeds", type=int, default=None, help="number of seeds 0..N-1 (default: the preset's)")
    bench.add_argument("--class-splits", type=_parse_tuple(str), default=None,
                       help="class splits, comma-separated: a, b, c or written ones such as 012345/6789")
    bench.add_argument("--protocols", type=_parse_tuple(str), default=None,
                       help="protocols, comma-separated: transductive, disjoint, unseen-ood")
    bench.add_argument("--strategies", type=_parse_tuple(str), default=None,
                       help="MCD strategies, comma-separated: separate, concat, split-bn, recalibrate")
    bench.add_argument("--selections", type=_parse_tuple(str), default=None,
                       help="model selections, comma-separated: ood-labels, last-epoch")
    for name, text in (("retrain", "train every stage again even if cached"),
                       ("resume", "continue an interrupted benchmark in --out"),
                       ("fresh", "delete the unfinished work in --out and start over"),
                       ("quiet", "no progress bars or log lines")):
        bench.add_argument(f"--{name}", action="store_true", help=text)
    return parser


def config_from_args(args: argparse.Namespace) -> MCDConfig:
    """The preset ``args.preset`` with every flag that was given applied.

    Raises:
        KeyError: on an unknown preset; ValueError: on a bad field value (from :class:`MCDConfig`).
    """
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(MCDConfig)
                 if f.name != "extra" and getattr(args, f.name) is not None}
    return get_preset(args.preset, **overrides)


def _report_error(err: BaseException, out: Path, tag: str = "") -> int:
    """Print ``err`` as one message (no traceback for a user's error) and return its exit code."""
    from .errors import exit_code

    code = exit_code(err)
    if code >= 128:  # TrainingInterrupted (SIGTERM/SIGINT) or Ctrl-C outside a training loop
        what = str(err) or f"SIGINT: finished stages and the last checkpoint in {out / 'checkpoints'} are kept."
        print(f"{tag}interrupted: {what} Continue with the same command and --resume.", file=sys.stderr)
    elif isinstance(err, ConfigError):
        print(f"{tag}error: {err.flag}: {err}", file=sys.stderr)
    elif isinstance(err, OSError) and code == 1 and type(err).__name__ in ("OSError", "PermissionError",
                                                                            "FileNotFoundError"):
        print(f"{tag}error: {type(err).__name__}: {err}", file=sys.stderr)
    elif not isinstance(err, (ValueError, OSError, RuntimeError, FloatingPointError)):
        raise err  # a bug, not a user error: keep the traceback
    else:
        print(f"{tag}error: {err}", file=sys.stderr)
    return code


def _benchmark(args: argparse.Namespace) -> int:
    from .experiments.benchmark import BENCHMARK_PRESETS, run_benchmark

    if args.list_presets:
        for name, p in BENCHMARK_PRESETS.items():
            print(f"{name}: {p.about}; splits {', '.join(p.class_splits)}; seeds {p.seeds} (at most {p.max_seeds})")
        return 0
    if args.out is None:
        print("error: --out DIR is required (the folder for results.json, scores/, summary.md)", file=sys.stderr)
        return 2
    try:
        run_benchmark(args.preset, args.out, args.seeds, args.class_splits, args.protocols, args.strategies,
                      args.selections, retrain=args.retrain, progress=not args.quiet, quiet=args.quiet,
                      resume=args.resume, fresh=args.fresh)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001  (one message, one exit code per error class)
        return _report_error(err, args.out)
    if not args.quiet:
        print((args.out / "summary.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "benchmark":
        return _benchmark(args)
    if args.list_presets:
        for name, cfg in PRESETS.items():
            changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                       if getattr(cfg, f.name) != getattr(MCDConfig(), f.name)}
            print(f"{name}: {changed or 'the MCDConfig defaults'}")
        return 0
    if args.out is None:
        print("error: --out DIR is required (the folder for results.json, results.md and plots)",
              file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        print(f"error: {err.flag}: {err}", file=sys.stderr)
        return 2
    except (KeyError, ValueError) as err:
        print(f"error: {err.args[0]}", file=sys.stderr)
        return 2
    from .experiments.run import run_reproduction
    from .training.distributed import check_sync_bn, cleanup, dist_env, is_main_process

    if cfg.sync_bn and dist_env().distributed:
        try:
            check_sync_bn(cfg.device)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    rank = os.environ.get("RANK", "0")
    tag = "" if rank == "0" else f"[rank {rank}] "  # under torchrun every rank reports; tell them apart
    main_rank = False
    try:
        run_reproduction(cfg, args.out, retrain=args.retrain, progress=not args.quiet, quiet=args.quiet,
                         resume=args.resume, fresh=args.fresh)
        main_rank = is_main_process()
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001  (one message, one exit code per error class)
        return _report_error(err, args.out, tag)
    finally:
        cleanup()  # the torchrun process group, if any
    if not args.quiet and main_rank:
        print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
