"""The `rzero` command."""

from __future__ import annotations

import argparse
import sys

from rzero.model.io import DTYPE_NAMES
from rzero.model.presets import PRESETS
from rzero.ops import DEVICE_NAMES, NUMERICS_MODES

DEVICE_HELP = "where the model, engine and trainer run; auto: cuda when available (cuda without one is an error)"


def _init_model(args: argparse.Namespace) -> int:
    from rzero.model.presets import init_model

    out = init_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, overwrite=args.force)
    print(f"wrote {args.preset} model to {out}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from rzero.check.checklist import main as check_main

    return check_main(args)


def _train(args: argparse.Namespace) -> int:
    from rzero.run.loop import main as train_main

    return train_main(args)


def _report(args: argparse.Namespace) -> int:
    from rzero.run.report import write_report

    print(f"wrote {write_report(args.run_dir)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rzero.eval.run import main as eval_main

    return eval_main(args)


def _serve(args: argparse.Namespace) -> int:
    from rzero.serve.app import main as serve_main

    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rzero", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-model", help="write a tiny randomly initialised model directory")
    p.add_argument("--preset", required=True, choices=list(PRESETS))
    p.add_argument("--out", required=True, help="model directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES, help="dtype of the saved weights")
    p.add_argument("--force", action="store_true", help="overwrite the model files of an existing model directory")
    p.set_defaults(func=_init_model)

    p = sub.add_parser("check", help="run the alignment checklist C0-C10 against a model directory")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--numerics", default="invariant", choices=NUMERICS_MODES)
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES)
    p.add_argument("--device", default="cpu", choices=DEVICE_NAMES, help=DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_check)

    p = sub.add_parser("train", help="run asynchronous RL (no arguments: the embedded default job)")
    p.add_argument("config", nargs="?", help="TOML run config (default: built-in defaults = configs/default.toml)")
    p.add_argument("--out", help="run directory (default: a new folder under runs/)")
    p.add_argument("--steps", type=int, help="number of trainer steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. rollout.max_lag=8")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--replay", metavar="RUN_DIR",
                   help="re-execute RUN_DIR's recorded steps into --out and check the result is the same run")
    p.set_defaults(func=_train)

    p = sub.add_parser("report", help="write PNG plots and a Markdown summary of a run")
    p.add_argument("run_dir")
    p.set_defaults(func=_report)

    p = sub.add_parser("eval", help="pass@1 and pass@k of a model on a suite of benchmarks (docs/eval.md)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--suite", required=True, help="TOML suite file listing the benchmarks")
    p.add_argument("--out", help="directory for results.json, samples.jsonl and results.md")
    p.add_argument("--k", type=int, help="the k of pass@k (overrides the suite)")
    p.add_argument("--samples", type=int, help="samples per problem, >= k (overrides the suite; default k)")
    p.add_argument("--temperature", type=float, help="sampling temperature, 0 = greedy (overrides the suite)")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold (overrides the suite)")
    p.add_argument("--max-tokens", type=int, help="most tokens generated per model turn (overrides the suite)")
    p.add_argument("--limit", type=int, help="at most this many problems per benchmark (a quick look)")
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES)
    p.add_argument("--numerics", default="invariant", choices=NUMERICS_MODES)
    p.add_argument("--device", default="cpu", choices=DEVICE_NAMES, help=DEVICE_HELP)
    p.add_argument("--seed", type=int, default=0, help="seed from which every problem's sampling seed is derived")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences decoded together")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: 1 below hidden size 1024, else one per core)")
    p.set_defaults(func=_eval)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (docs/serve.md)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES)
    p.add_argument("--numerics", default="invariant", choices=NUMERICS_MODES)
    p.add_argument("--device", default="cpu", choices=DEVICE_NAMES, help=DEVICE_HELP)
    p.add_argument("--served-model-name", help="model name clients ask for (default: the directory's name)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests decoded together")
    p.add_argument("--decode-steps-per-call", type=int, default=16,
                   help="decode steps one model call may run (1: tokens stream one step at a time)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: 1 below hidden size 1024, else one per core)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="engine seed, from which requests without a seed get one")
    p.add_argument(
        "--max-request-bytes", type=int, default=4 * 1024**2, help="largest request body accepted (larger: HTTP 413)"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as err:  # OSError: unwritable paths, full disks
        print(f"rzero {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
