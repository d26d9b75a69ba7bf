"""The ``nanguard`` command: demo, zoo, report, replay, doctor. Subcommands load their code on first use."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nanguard.errors import NanguardError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from nanguard.zoo.demo import list_faults, run_demo

    if args.list:
        print(list_faults())
        return 0
    return run_demo(args.fault, steps=args.steps, ranks=args.ranks, run_dir=args.run_dir, seed=args.seed)


def _report(args: argparse.Namespace) -> int:
    from nanguard.report.main import run_report

    return run_report(args.run_dir, html=args.html, as_json=args.json)


def _doctor(args: argparse.Namespace) -> int:
    from nanguard.audit.env import run

    return run(as_json=args.json)


def _replay(args: argparse.Namespace) -> int:
    from nanguard.cli.replay import main_replay
    from nanguard.report.terminal import Console

    bundle, diag = main_replay(args.bundle, args.model, args.weights, args.fn)
    console = Console()
    if diag is None:
        console.line(f"{bundle.path}: the replay is finite: the fault does not reproduce on this machine")
        return 1
    diag.step = bundle.step
    console.diagnosis(diag)
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from nanguard.zoo.runner import run_zoo

    return run_zoo(ranks=args.ranks, as_json=args.json, only=args.only, group=args.group)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanguard",
        description="Catch the first NaN/Inf in PyTorch training, name its cause, keep training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train a tiny GPT that breaks on purpose, then locate and explain the NaN",
        description="Train the built-in tiny GPT; at a chosen step a fault from the zoo makes it "
        "go non-finite, the guard skips the step, and the diagnosis is printed.",
    )
    demo.add_argument("--fault", default="padding_fully_masked", help="zoo scenario (see --list)")
    demo.add_argument("--list", action="store_true", help="list the faults and exit")
    demo.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    demo.add_argument("--ranks", type=int, default=1, help="spawn N gloo ranks on CPU (default 1)")
    demo.add_argument("--run-dir", default=None, help="write events and bundles here")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    zoo = sub.add_parser("zoo", help="run every fault scenario under the guard and score the diagnoses")
    zoo.add_argument("--ranks", type=int, default=1, help="also run the distributed scenarios on N gloo ranks")
    zoo.add_argument("--json", action="store_true", help="print the results as JSON")
    zoo.add_argument("--only", default=None, metavar="NAME", help="run one scenario")
    zoo.add_argument("--group", default="all", choices=("all", "gpt", "wild"),
                     help="tiny-GPT scenarios, wild ones (public bug reports, via ng.locate), or both")  # fmt: skip
    zoo.set_defaults(func=_zoo)

    report = sub.add_parser("report", help="summarize a run directory; --html writes a self-contained page")
    report.add_argument("run_dir", metavar="RUN_DIR", help="directory holding events-rank*.jsonl and bundles/")
    report.add_argument("--html", default=None, metavar="OUT", help="write one self-contained HTML file")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.set_defaults(func=_report)

    replay = sub.add_parser("replay", help="re-run a captured bad step and print its diagnosis")
    replay.add_argument("bundle", metavar="BUNDLE", help="a bundle directory (run_dir/bundles/step-...)")
    replay.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY", help="builds the model")
    replay.add_argument("--weights", default=None, metavar="CKPT", help="state dict (.pt or .safetensors)")
    replay.add_argument("--fn", default=None, metavar="PKG.MODULE:FUNCTION", help="fn(model) -> step(batch)")
    replay.set_defaults(func=_replay)

    doctor = sub.add_parser("doctor", help="check torch, CUDA, NCCL and debug settings")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nanguard`` and ``python -m nanguard``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        parser.exit(2, f"nanguard {args.command}: error: {err}\n")
    except NanguardError as err:  # a corrupt bundle, an unreadable run directory
        print(f"nanguard {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
