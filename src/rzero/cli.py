"""The `rzero` command."""

from __future__ import annotations

import argparse
import sys


def _init_model(args: argparse.Namespace) -> int:
    from rzero.model.presets import init_model

    out = init_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} model to {out}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from rzero.check.checklist import main as check_main

    return check_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rzero", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-model", help="write a tiny randomly initialised model directory")
    p.add_argument("--preset", required=True, choices=["tiny-dense", "tiny-moe"])
    p.add_argument("--out", required=True, help="model directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of the saved weights")
    p.set_defaults(func=_init_model)

    p = sub.add_parser("check", help="run the alignment checklist C0-C10 against a model directory")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--numerics", default="invariant", choices=["invariant", "standard"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"rzero {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
