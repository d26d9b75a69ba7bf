"""The ``nanguard`` command: demo, drill, zoo, report, replay, bisect, doctor.

Subcommands load their code on first use: ``--help`` and ``--version`` never import torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from nanguard import __version__
from nanguard.errors import NanguardError

__all__ = ["main"]

DEFAULT_RUN_DIR = "runs/demo"

ENVIRONMENT = """\
environment (read by every Guard, so a job script can change them without touching code):
  NANGUARD_POLICY=skip|rollback|raise|auto  the policy of every Guard, overriding the code's
  NANGUARD_RUN_DIR=DIR                      write events and bundles here when the code sets no run_dir
  NANGUARD_DISABLE=1                        turn every Guard into a plain optimizer step (no checks)
  NANGUARD_INJECT=KIND@step=N[,rank=R];...  a fire drill: plant faults (see `nanguard drill --help`)
`nanguard doctor` shows the values in effect."""


def _demo(args: argparse.Namespace) -> int:
    from nanguard.zoo.demo import list_faults, run_demo

    if args.list:
        print(list_faults())
        return 0
    run_dir = None if args.no_run_dir else args.run_dir
    return run_demo(args.fault, steps=args.steps, ranks=args.ranks, run_dir=run_dir, seed=args.seed)


def _drill(args: argparse.Namespace) -> int:
    from nanguard.zoo.drill import run_drill

    run_dir = None if args.no_run_dir else args.run_dir
    if args.ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
    return run_drill(ranks=args.ranks, steps=args.steps, inject=args.inject, run_dir=run_dir)


def _report(args: argparse.Namespace) -> int:
    from nanguard.report.main import run_report

    return run_report(args.run_dir, html=args.html, as_json=args.json, run=args.run, list_runs=args.runs)


def _doctor(args: argparse.Namespace) -> int:
    # torch refuses to import under an invalid TORCH_DISTRIBUTED_DEBUG: import without it, then report it.
    saved = os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    try:
        from nanguard.audit.env import run
    finally:
        if saved is not None:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = saved
    return run(as_json=args.json)


def _replay(args: argparse.Namespace) -> int:
    import time

    from nanguard.cli.replay import main_replay, version_note
    from nanguard.report.terminal import Console

    console, status = Console(), Console(sys.stderr)  # news on stderr: stdout holds the diagnosis alone
    start = time.perf_counter()

    def starting() -> None:
        nonlocal start
        status.line(f"nanguard: replaying {args.bundle} under the tracer…")
        start = time.perf_counter()

    result = main_replay(args.bundle, args.model, args.weights, args.fn, starting=starting)
    status.line(f"nanguard: replayed in {time.perf_counter() - start:.1f}s")
    note = version_note(result.bundle)
    if note is not None:
        status.line(note)
    if result.diagnosis is None:
        console.line(result.finite_hint())
        return 1
    if result.weights is not None:
        console.line(f"weights: {result.weights}")
    result.diagnosis.step = result.bundle.step
    console.diagnosis(result.diagnosis)
    return 0


def _bisect(args: argparse.Namespace) -> int:
    import json

    from nanguard import dist
    from nanguard.bisection import bisect
    from nanguard.report.terminal import Console

    status = Console(sys.stderr)
    found = bisect(
        args.setup,
        args.checkpoints,
        until=args.until,
        run_dir=args.run_dir,
        progress=lambda total, label: status.progress(total, label, echo=False),
    )
    if dist.rank() != 0:  # every rank found the same; one prints it
        return 0 if found.first_bad_step is not None else 1
    if args.json:
        print(json.dumps(found.to_dict(), indent=2), flush=True)
        return 0 if found.first_bad_step is not None else 1
    console = Console()
    rows = [
        [c.path, "-" if c.step is None else str(c.step), _checkpoint_state(c, found.checkpoint)]
        for c in found.checkpoints
    ]
    console.table(["checkpoint", "step", "state"], rows, title="checkpoints")
    console.line(found.summary())
    if found.rows is not None:
        console.line(f"rows of the batch holding the bad values: {found.rows}")
    console.diagnosis(found.diagnosis)
    return 0 if found.first_bad_step is not None else 1


def _checkpoint_state(c: object, chosen: str) -> str:
    from nanguard.bisection import Checkpoint

    assert isinstance(c, Checkpoint)
    if c.step is None:
        return f"not a checkpoint: {c.refused}"
    if c.nonfinite is not None:
        return f"non-finite: {c.nonfinite}"
    return "finite, replayed from here" if c.path == chosen else "finite"


def _zoo(args: argparse.Namespace) -> int:
    from nanguard.zoo.runner import run_zoo

    if args.remedies:
        from nanguard.zoo.remedy_scenarios import print_scores

        return print_scores(as_json=args.json)
    only = [name.strip() for value in args.only or () for name in value.split(",") if name.strip()]
    return run_zoo(ranks=args.ranks, as_json=args.json, only=only or None, seed=args.seed, group=args.group)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanguard",
        description="Catch the first NaN/Inf in PyTorch training, name its cause, keep training.",
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nanguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train a tiny GPT that breaks on purpose, then locate and explain the NaN",
        description="Train the built-in tiny GPT; at a chosen step a fault from the zoo makes it "
        "go non-finite, the guard skips the step, and the diagnosis is printed.",
    )
    demo.add_argument("--fault", default="padding_fully_masked", help="zoo scenario (see --list)")
    demo.add_argument("--list", action="store_true", help="list the faults and exit")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: the fault's own)")
    demo.add_argument(
        "--ranks", type=int, default=1, help="spawn N gloo ranks on CPU (default 1; distributed faults spawn 2)"
    )
    demo.add_argument(
        "--run-dir", default=DEFAULT_RUN_DIR, help=f"write events and bundles here (default {DEFAULT_RUN_DIR})"
    )
    demo.add_argument("--no-run-dir", action="store_true", help="write nothing to disk")
    demo.add_argument("--seed", type=int, default=0, help="seed of the model's init and the data (default 0)")
    demo.set_defaults(func=_demo)

    drill = sub.add_parser(
        "drill",
        help="a fire drill: plant every kind of fault in the tiny GPT's guarded run, check it recovers",
        description="Train the built-in tiny GPT under policy='auto' while NANGUARD_INJECT's injector plants "
        "faults through their real paths (nan_grad, inf_loss, nan_param, spike_loss, corrupt_allreduce, stall), "
        "then check that each was caught, every rank decided alike, every skip left the weights bit-identical, "
        "every rollback restored its snapshot, and the final weights equal a run that never saw the dropped "
        "batches. Exit 0: the drill passed; 1: a promise failed. The same faults go into any job as "
        "NANGUARD_INJECT='nan_grad@step=100,rank=3;stall@step=600,rank=1,seconds=5'.",
    )
    drill.add_argument("--ranks", type=int, default=1, help="spawn N gloo ranks on CPU (default 1)")
    drill.add_argument("--steps", type=int, default=64, help="training steps (default 64)")
    drill.add_argument(
        "--inject",
        default=None,
        metavar="SPEC",
        help="the faults, as NANGUARD_INJECT writes them (default: one of each kind)",
    )
    drill.add_argument(
        "--run-dir", default="runs/drill", help="write events here (default runs/drill); see `nanguard report`"
    )
    drill.add_argument("--no-run-dir", action="store_true", help="write nothing to disk")
    drill.set_defaults(func=_drill)

    zoo = sub.add_parser(
        "zoo",
        help="run every fault scenario under the guard and score the diagnoses",
        description="Run the fault zoo: the tiny-GPT scenarios (each breaks the model one way at a known step, "
        "trained under the guard) and the wild ones (NaN bugs from public issue trackers, one faulty step each, "
        "located with ng.locate). Each diagnosis is scored on cause, op, module, phase, rank(s) and detection "
        "step, where the fault determines them; healthy scenarios must never trip. Exit 0: every scenario "
        "scored right; 1: one did not.",
    )
    zoo.add_argument("--ranks", type=int, default=1, help="also run the distributed scenarios on N gloo ranks")
    zoo.add_argument("--json", action="store_true", help="print the results as JSON")
    zoo.add_argument(
        "--only", action="append", metavar="NAME[,NAME]", help="run only these scenarios (repeat or comma-separate)"
    )
    zoo.add_argument("--seed", type=int, default=0, help="seed of the models' init and the data (default 0)")
    zoo.add_argument("--remedies", action="store_true", help="score skip, rollback and auto on the remedy scenarios")
    zoo.add_argument(
        "--group",
        default="all",
        choices=("all", "gpt", "wild"),
        help="tiny-GPT scenarios, wild ones (public bug reports, via ng.locate), or both",
    )
    zoo.set_defaults(func=_zoo)

    report = sub.add_parser(
        "report",
        help="summarize a run directory; --html writes a self-contained page",
        description="Read the event logs (events-rank*.jsonl) and repro bundles a guard wrote to its run_dir, "
        "and summarize the run: steps, trips with their diagnoses, skips, rollbacks, spikes, remedies, fire "
        "drills and trips per host and device. A run_dir written to more than once shows its latest run (--run "
        "ID another, --runs lists them). --html writes one self-contained page with plots (needs the "
        "report extra: matplotlib). Exit 0: reported; 1: nothing readable there (or no such run); 2: --run or "
        "--runs with several RUN_DIRs.",
    )
    report.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        nargs="+",
        help="directory holding events-rank*.jsonl and bundles/; several (a job and its restarts) "
        "add one table of trips per host and device",
    )
    report.add_argument("--html", default=None, metavar="OUT", help="write one self-contained HTML file")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.add_argument(
        "--run",
        default=None,
        metavar="ID",
        help="the run to show when the directory holds several (a run_dir reused): its id from --runs; "
        "default: the latest; '-': the logs written before run ids",
    )
    report.add_argument("--runs", action="store_true", help="list the runs in RUN_DIR, oldest first, and stop")
    report.set_defaults(func=_report)

    replay = sub.add_parser(
        "replay",
        help="re-run a captured bad step and print its diagnosis",
        description="Build the model, load the weights (--weights, else the bundle's own when it carries them: "
        "Guard(bundle_weights=True)), and replay the captured step under the tracer. Exit 0: diagnosed; "
        "1: the replay is finite or the bundle is unreadable; 2: a bad option.",
    )
    replay.add_argument("bundle", metavar="BUNDLE", help="a bundle directory (run_dir/bundles/step-...)")
    replay.add_argument(
        "--model",
        required=True,
        metavar="PKG.MODULE:FACTORY",
        help="an importable function that builds the model with no arguments",
    )
    replay.add_argument(
        "--weights",
        default=None,
        metavar="PATH",
        help="a state dict (.safetensors, or .pt read with weights_only=True); overrides the bundle's weights",
    )
    replay.add_argument(
        "--fn",
        default=None,
        metavar="PKG.MODULE:FUNCTION",
        help="an importable FUNCTION(model) that returns step(batch): zero the gradients, run the forward and "
        "backward of one step on the bundle's batch, return the loss. Default: model(**batch) for a dict batch "
        "(model(*batch) for a list), the loss read from its output",
    )
    replay.set_defaults(func=_replay)

    bis = sub.add_parser(
        "bisect",
        help="find the first bad step of a run that had no guard, from its checkpoints",
        description="FUNCTION() returns a dict: model, optimizer, optionally scheduler and scaler; load(path) -> "
        "the step of the checkpoint it restored; batches(start) -> the run's batches from that step on; "
        "closure(batch) -> loss (zero the gradients, forward, backward). Every checkpoint is checked for "
        "non-finite values, the steps after the latest finite one are replayed under a guard, and the first "
        "that trips is diagnosed. Under torchrun every rank runs it and rank 0 prints. Exit 0: a bad step "
        "found; 1: every step is finite (or no finite checkpoint); 2: a bad option.",
    )
    bis.add_argument("setup", metavar="PKG.MODULE:FUNCTION", help="an importable function returning the dict")
    bis.add_argument("--checkpoints", required=True, metavar="DIR", help="the run's checkpoints, one entry each")
    bis.add_argument(
        "--until", type=int, default=None, metavar="STEP", help="replay no step after STEP (default: every batch)"
    )
    bis.add_argument("--json", action="store_true", help="print the result as one JSON object")
    bis.add_argument(
        "--run-dir", default=None, metavar="DIR", help="keep the replay's events and the bad step's bundle here"
    )
    bis.set_defaults(func=_bisect)

    doctor = sub.add_parser(
        "doctor",
        help="check torch, CUDA, NCCL, debug settings and NANGUARD_* variables",
        description="Check this environment for a guarded run: the torch version (and whether nanguard was "
        "tested with it), CUDA, cuDNN, NCCL and the GPUs, debug switches left on that cost speed (anomaly "
        "detection, deterministic algorithms), the variables worth setting when hunting a distributed NaN, and "
        "the NANGUARD_* variables in effect. Exit 0: no error; 1: an error (a warning does not count).",
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
