"""Command line: ``python -m mcd_helpers reproduce`` and ``python -m mcd_helpers benchmark``.

Examples::

    python -m mcd_helpers reproduce --preset quick --out runs/demo            # CPU, about 5 minutes
    python -m mcd_helpers reproduce --preset quick --out runs/demo --resume   # after an interruption
    python -m mcd_helpers reproduce --preset quick --out runs/x --strategies concat --margin 0.8
    torchrun --standalone --nproc_per_node=2 -m mcd_helpers reproduce --preset quick --out runs/ddp
    python -m mcd_helpers reproduce --preset paper-cifar10-densenet --out runs/c10 --amp bf16 --channels-last
    python -m mcd_helpers benchmark --preset near-ood-quick --out runs/near-ood-quick   # CPU, <= 20 minutes
    python -m mcd_helpers benchmark --preset near-ood --out runs/near-ood --seeds 10

Every field of :class:`~mcd_helpers.config.MCDConfig` is a flag (``finetune_lr`` -> ``--finetune-lr``);
tuple fields take comma-separated values, yes/no fields are switches (``--compile`` / ``--no-compile``).

Progress bars are drawn on a terminal only: a log redirected to a file gets the log lines alone.
SIGTERM or SIGINT (Ctrl-C) finishes the step, saves, and exits with 143 or 130; ``--resume`` with the
same ``--out`` and settings continues exactly. A run that finds unfinished work in ``--out`` stops
unless given ``--resume`` or ``--fresh``. Exit codes: 0 done; 1 a failure during the run (diverged,
unreadable checkpoint, an OOD set failed, a full disk); 2 a setting or the environment (bad value,
data not found, folder not writable or in use, unfinished work); 130 / 143 interrupted.
"""

import argparse
import inspect
import json
import re
import sys
import typing
from dataclasses import fields
from pathlib import Path

from .config import PRESETS, SELECTIONS, MCDConfig, get_preset
from .forwards import STRATEGIES
from .splits import CLASS_SPLITS, PROTOCOLS
from .errors import ConfigError, exit_code


def _csv(kind):
    return lambda text: tuple(kind(v.strip()) for v in text.split(",") if v.strip())


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; each field flag's help shows the default of the preset named in ``argv`` (else ``quick``)."""
    parser = argparse.ArgumentParser(prog="python -m mcd_helpers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("reproduce", help="pre-train, fine-tune with MCD, evaluate MSP, ODIN, energy and MCD",
                         description="Pre-train (or load the cached network), fine-tune per OOD set and strategy, "
                         "evaluate MSP, ODIN, energy and MCD; write results.json, results.md and plots into --out.")
    bench = sub.add_parser("benchmark", help="near-OOD benchmark: protocols x strategies x methods over seeds",
                           description="A preset's grid over seeds: held-out Fashion-MNIST classes, protocols, MCD "
                           "strategies, MSP, ODIN, energy; write results.json, scores/, summary.md, plots into --out.")
    for p, default in ((rep, "quick"), (bench, "near-ood-quick")):
        shows = "; --preset NAME --help shows NAME's values" if p is rep else ""
        p.add_argument("--preset", default=default, help=f"named settings (default {default}); see --list-presets{shows}")
        p.add_argument("--list-presets", action="store_true", help="show the presets and exit")
        p.add_argument("--out", type=Path, help="output folder (required unless --list-presets)")
        p.add_argument("--retrain", action="store_true", help="train every stage again even if cached (each once)")
        p.add_argument("--resume", action="store_true", help="continue the interrupted run in --out (same settings)")
        p.add_argument("--fresh", action="store_true", help="delete unfinished work and results in --out, start over")
        p.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    splits = "comma-separated, of " + ",".join(CLASS_SPLITS) + " or written as ID/OOD class digits (012345/6789)"
    for name, kind, values in (("seeds", int, "a count"), ("class-splits", _csv(str), splits),
                               ("protocols", _csv(str), PROTOCOLS), ("strategies", _csv(str), STRATEGIES),
                               ("selections", _csv(str), SELECTIONS)):
        of = values if isinstance(values, str) else "comma-separated, of " + ",".join(values)
        bench.add_argument(f"--{name}", type=kind, help=f"{name.replace('-', ' ')}: {of} (default: the preset's)")
    bench.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: the preset's, cpu)")
    rep.add_argument("--config", type=Path, help="rerun a run: its DIR/config.json instead of a preset (flags override)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="quick")
    name = pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].preset
    name = name if name in PRESETS else "quick"  # an unknown name is refused when the command runs
    # each field's help: its comment in MCDConfig's source; None (argparse's default): not given
    comments = dict(re.findall(r"^\s+(\w+): .*?#\s*(.+)$", inspect.getsource(MCDConfig), re.M))
    for f, hint in typing.get_type_hints(MCDConfig).items():
        text = f.replace("_", " ") + (f": {comments[f]}" if f in comments else "")
        kind = (dict(action=argparse.BooleanOptionalAction) if hint is bool else
                dict(type=_csv(typing.get_args(hint)[0]) if typing.get_origin(hint) is tuple else hint))
        value = ",".join(map(str, v)) if isinstance(v := getattr(PRESETS[name], f), tuple) else v
        rep.add_argument(f"--{f.replace('_', '-')}", dest=f, help=f"{text} ({name}: {value})".replace("%", "%%"), **kind)
    return parser


def config_from_args(args: argparse.Namespace) -> MCDConfig:
    """The preset ``args.preset``, or the run's ``args.config`` file, with every flag given applied (KeyError: an
    unknown preset; ConfigError: a bad value, or a config file that is unreadable or names an unknown field)."""
    flags = {f.name: getattr(args, f.name) for f in fields(MCDConfig) if getattr(args, f.name) is not None}
    if getattr(args, "config", None) is None:
        return get_preset(args.preset, **flags)
    try:
        saved = json.loads(args.config.read_text())
        wrong = (f"a JSON {type(saved).__name__}, not an object" if not isinstance(saved, dict) else
                 (unknown := sorted(set(saved) - {f.name for f in fields(MCDConfig)})) and f"unknown fields {unknown}")
    except (OSError, ValueError) as err:  # missing, not JSON
        wrong = f"{type(err).__name__}: {err}"
    if wrong:
        raise ConfigError("config", f"--config {args.config} is not a run's config.json ({wrong}); pass the "
                                    "config.json that reproduce wrote into its --out folder.")
    return MCDConfig(**{**saved, **flags})


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    import os

    tag = "" if os.environ.get("RANK", "0") == "0" else f"[rank {os.environ['RANK']}] "  # torchrun: every rank reports
    bench = args.command == "benchmark"
    try:
        if args.list_presets:
            from .benchmark import BENCHMARK_PRESETS

            for name, p in (BENCHMARK_PRESETS if bench else PRESETS).items():
                about = (f"{p.about}; splits {', '.join(p.class_splits)}; seeds {p.seeds} (at most {p.max_seeds})"
                         if bench else {f.name: value for f in fields(p) if (value := getattr(p, f.name)) != f.default})
                print(f"{name}: {about or 'the MCDConfig defaults'}")
            return 0
        if args.out is None:
            raise ConfigError("out", "--out DIR is required (the folder for results.json, "
                                     f"{'scores/, summary.md' if bench else 'results.md and plots'}).")
        terminal = getattr(sys.stderr, "isatty", bool)()  # progress bars on a terminal only, not in a redirected log
        how = dict(retrain=args.retrain, progress=not args.quiet and terminal, quiet=args.quiet, resume=args.resume,
                   fresh=args.fresh)
        if bench:
            from .benchmark import run_benchmark

            run_benchmark(args.preset, args.out, args.seeds, args.class_splits, args.protocols, args.strategies,
                          args.selections, device=args.device, **how)
        else:
            from .run import run_reproduction

            run_reproduction(config_from_args(args), args.out, **how)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001  (one message and one exit code per error class)
        code = exit_code(err)
        if code < 128 and not isinstance(err, (ValueError, KeyError, OSError, RuntimeError, FloatingPointError)):
            raise  # a bug, not a user's error: keep the traceback
        print(tag + (f"interrupted: {err or 'Ctrl-C'} Continue with the same command and --resume." if code >= 128
                     else f"error: {err.flag}: {err}" if isinstance(err, ConfigError)
                     else f"error: {err.args[0] if isinstance(err, KeyError) else err}"), file=sys.stderr)
        return code
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if not args.quiet and not tag:
        print((args.out / ("summary.md" if bench else "results.md")).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
