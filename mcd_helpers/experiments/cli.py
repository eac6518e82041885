"""Command line: ``python -m mcd_helpers reproduce`` and ``python -m mcd_helpers benchmark``.

Examples::

    python -m mcd_helpers reproduce --preset quick --out runs/demo            # CPU, minutes
    python -m mcd_helpers reproduce --preset quick --out runs/demo --resume   # after a stop
    python -m mcd_helpers reproduce --preset quick --out runs/x --strategies concat --margin 0.8
    torchrun --standalone --nproc_per_node=2 -m mcd_helpers reproduce --preset quick --out runs/ddp
    python -m mcd_helpers reproduce --preset paper-cifar10-densenet --out runs/c10 --amp bf16
    python -m mcd_helpers benchmark --preset near-ood-quick --out runs/near-ood-quick
    python -m mcd_helpers benchmark --preset primary --out runs/primary --seeds 20-39

Every field of :class:`~mcd_helpers.experiments.config.MCDConfig` is a flag of ``reproduce``
(``finetune_lr`` -> ``--finetune-lr``); tuple fields take comma-separated values, yes/no fields are
switches (``--compile`` / ``--no-compile``).

Progress bars are drawn on a terminal only: a log redirected to a file gets the log lines alone.
SIGTERM or SIGINT (Ctrl-C) finishes the step, saves, and exits with 143 or 130; ``--resume`` with
the same ``--out`` and settings continues exactly. A run that finds unfinished work in ``--out``
stops unless given ``--resume`` or ``--fresh``. Exit codes: 0 done; 1 a failure during the run
(diverged, unreadable checkpoint, an OOD set failed, a full disk); 2 a setting or the environment
(bad value, data not found, folder not writable or in use, unfinished work, benchmark under
torchrun); 130 / 143 interrupted.
"""

import argparse
import inspect
import json
import os
import re
import signal
import sys
import typing
from dataclasses import fields
from pathlib import Path

from ..errors import ConfigError, TrainingInterrupted
from ..splits import CLASS_SPLITS, PROTOCOLS
from ..strategies import STRATEGIES
from .config import PRESETS, SELECTIONS, MCDConfig, get_preset


def _csv(kind):
    return lambda text: tuple(kind(v.strip()) for v in text.split(",") if v.strip())


SWITCHES = {  # both commands'
    "--list-presets": "show the presets and exit",
    "--retrain": "train every stage again even if cached (each once)",
    "--resume": "continue the interrupted run in --out (same settings)",
    "--fresh": "delete unfinished work and results in --out, start over",
    "--quiet": "no progress bars or log lines",
}
CHOICES = {  # the benchmark's comma-separated flags, with the values each takes
    "class-splits": ",".join(CLASS_SPLITS) + " or written as ID/OOD class digits (012345/6789)",
    "protocols": ",".join(PROTOCOLS),
    "strategies": ",".join(STRATEGIES),
    "selections": ",".join(SELECTIONS),
}


def _field_help() -> dict[str, str]:
    """Each MCDConfig field's comment in its source: beside it, else the comment lines above it."""
    found, above = {}, []
    for line in inspect.getsource(MCDConfig).splitlines():
        code, _, comment = (part.strip() for part in line.partition("#"))
        if field := re.fullmatch(r"(\w+): .*", code):
            found[field[1]] = comment or " ".join(above)
        # comment lines gather until a field takes them; a section's banner (# ---) is none
        above = above + [comment] if not code and comment and comment[0] != "-" else []
    return found


def _config_flags(rep: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """A flag per MCDConfig field; its help shows the default of the preset named in ``argv``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="quick")
    name = pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0].preset
    name = name if name in PRESETS else "quick"  # an unknown name is refused when the command runs
    comments = _field_help()
    for f, hint in typing.get_type_hints(MCDConfig).items():  # None (argparse's default): not given
        kind = dict(
            type=_csv(typing.get_args(hint)[0]) if typing.get_origin(hint) is tuple else hint
        )
        value = getattr(PRESETS[name], f)
        value = ",".join(map(str, value)) if isinstance(value, tuple) else value
        text = f"{f.replace('_', ' ')}: {comments[f]} ({name}: {value})".replace("%", "%%")
        if hint is bool:
            kind = dict(action=argparse.BooleanOptionalAction)
        rep.add_argument(f"--{f.replace('_', '-')}", dest=f, help=text, **kind)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; each field flag's help shows the default of the preset named in ``argv`` (else
    ``quick``)."""
    parser = argparse.ArgumentParser(
        prog="python -m mcd_helpers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser(
        "reproduce",
        help="pre-train, fine-tune with MCD, evaluate MSP, ODIN, energy and MCD",
        description="Pre-train (or load the cached network), fine-tune per OOD set and strategy, "
        "evaluate MSP, ODIN, energy and MCD; write results.json, results.md and plots into --out.",
    )
    bench = sub.add_parser(
        "benchmark",
        help="near-OOD benchmark: protocols x strategies x methods over seeds",
        description="A preset's grid over seeds: held-out Fashion-MNIST classes, protocols, MCD "
        "strategies, MSP, ODIN, energy; write results.json, scores/, summary.md, plots into --out.",
    )
    for p, default in ((rep, "quick"), (bench, "near-ood-quick")):
        shows = "; --preset NAME --help shows NAME's values" if p is rep else ""
        p.add_argument(
            "--preset",
            default=default,
            help=f"named settings (default {default}); see --list-presets{shows}",
        )
        p.add_argument("--out", type=Path, help="output folder (required unless --list-presets)")
        for flag, text in SWITCHES.items():
            p.add_argument(flag, action="store_true", help=text)
    bench.add_argument(
        "--seeds", help="a count N (seeds 0 to N-1) or a range A-B (default: the preset's)"
    )
    for flag, values in CHOICES.items():
        of = f"{flag.replace('-', ' ')}: comma-separated, of {values} (default: the preset's)"
        bench.add_argument(f"--{flag}", type=_csv(str), help=of)
    bench.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: the preset's, cpu)")
    rep.add_argument(
        "--config",
        type=Path,
        help="rerun a run: its DIR/config.json instead of a preset (flags override)",
    )
    _config_flags(rep, argv)
    return parser


def config_from_args(args: argparse.Namespace) -> MCDConfig:
    """The preset ``args.preset``, or the run's ``args.config`` file, with every flag given applied.

    Raises:
        KeyError: an unknown preset.
        ConfigError: a bad value, or a config file that is unreadable or names an unknown field.
    """
    flags = {
        f.name: getattr(args, f.name)
        for f in fields(MCDConfig)
        if getattr(args, f.name) is not None
    }
    if getattr(args, "config", None) is None:
        return get_preset(args.preset, **flags)
    try:
        saved = json.loads(args.config.read_text())
        wrong = "" if isinstance(saved, dict) else f"a JSON {type(saved).__name__}, not an object"
        if not wrong and (unknown := sorted(set(saved) - {f.name for f in fields(MCDConfig)})):
            wrong = f"unknown fields {unknown}"
    except (OSError, ValueError) as err:  # missing, not JSON
        wrong = f"{type(err).__name__}: {err}"
    if wrong:
        raise ConfigError(
            "config",
            f"--config {args.config} is not a run's config.json ({wrong}); pass the config.json "
            "that reproduce wrote into its --out folder.",
        )
    return MCDConfig(**{**saved, **flags})


def exit_code(err: BaseException) -> int:
    """``128 + signal`` when interrupted; 2 for what the user fixes before rerunning (a setting,
    missing data, a folder that cannot be written or is in use); 1 for a failure during the run."""
    if isinstance(err, (TrainingInterrupted, KeyboardInterrupt)):
        return 128 + getattr(err, "signal", signal.SIGINT)  # Ctrl-C without our handler: SIGINT
    return 2 if isinstance(err, (ValueError, KeyError, FileNotFoundError, PermissionError)) else 1


def _message(err: BaseException, code: int) -> str:
    """The one line the command prints for ``err``."""
    if code >= 128:
        return f"interrupted: {err or 'Ctrl-C'} Continue with the same command and --resume."
    if isinstance(err, ConfigError):
        return f"error: {err.flag}: {err}"
    return f"error: {err.args[0] if isinstance(err, KeyError) else err}"


def _list_presets(bench: bool) -> None:
    from .benchmark import BENCHMARK_PRESETS

    for name, p in (BENCHMARK_PRESETS if bench else PRESETS).items():
        about = {f.name: value for f in fields(p) if (value := getattr(p, f.name)) != f.default}
        if bench:
            splits = ", ".join(p.class_splits)
            about = f"{p.about}; splits {splits}; seeds {p.seeds} (at most {p.max_seeds})"
        print(f"{name}: {about or 'the MCDConfig defaults'}")


def _run(args: argparse.Namespace, bench: bool) -> None:
    if args.out is None:
        made = "scores/, summary.md" if bench else "results.md and plots"
        raise ConfigError("out", f"--out DIR is required (the folder for results.json, {made}).")
    terminal = getattr(sys.stderr, "isatty", bool)()  # progress bars on a terminal only
    how = dict(
        retrain=args.retrain,
        progress=not args.quiet and terminal,
        quiet=args.quiet,
        resume=args.resume,
        fresh=args.fresh,
    )
    if bench:
        from .benchmark import run_benchmark

        chosen = (args.class_splits, args.protocols, args.strategies, args.selections)
        run_benchmark(args.preset, args.out, args.seeds, *chosen, device=args.device, **how)
    else:
        from .reproduce import run_reproduction

        run_reproduction(config_from_args(args), args.out, **how)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    rank = os.environ.get("RANK", "0")
    tag = "" if rank == "0" else f"[rank {rank}] "  # torchrun: every rank reports
    bench = args.command == "benchmark"
    try:
        if args.list_presets:
            _list_presets(bench)
        else:
            _run(args, bench)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001  (a message and a code per error)
        code = exit_code(err)
        user_errors = (ValueError, KeyError, OSError, RuntimeError, FloatingPointError)
        if code < 128 and not isinstance(err, user_errors):
            raise  # a bug, not a user's error: keep the traceback
        print(tag + _message(err, code), file=sys.stderr)
        return code
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if not args.quiet and not tag and not args.list_presets:
        print((args.out / ("summary.md" if bench else "results.md")).read_text())
    return 0
