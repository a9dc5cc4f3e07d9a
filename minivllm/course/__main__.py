"""``python -m minivllm.course``: ``make-exercises [--check]`` (exercises/ from solutions/; with
--check, exit 1 if exercises/ is stale) and ``run NOTEBOOK...`` (re-run, save outputs)."""

from __future__ import annotations

import argparse
import sys

from minivllm.course.exercises import stale_exercises, write_exercises


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.course")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-exercises", help="write exercises/ from solutions/")
    make.add_argument("--root", default=".", help="the repository root (holds solutions/)")
    make.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 if exercises/ differs from what would be written")
    run = sub.add_parser("run", help="execute notebooks top to bottom and save their outputs")
    run.add_argument("notebooks", nargs="+")
    run.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    if args.command == "make-exercises" and args.check:
        stale = stale_exercises(args.root)
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        if stale:
            print("run: python -m minivllm.course make-exercises", file=sys.stderr)
        return 1 if stale else 0
    if args.command == "make-exercises":
        for path in write_exercises(args.root):
            print(f"wrote {path}")
        return 0
    from minivllm.course.notebooks import run_in_place

    for path in args.notebooks:
        print(f"running {path}", flush=True)
        run_in_place(path, timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
