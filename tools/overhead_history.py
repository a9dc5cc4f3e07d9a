"""Host time per decode step of two versions of the engine, measured side by side.

    python tools/overhead_history.py OLD_TREE NEW_TREE --json out.json

Each tree is a checkout of this repository (e.g. ``git worktree add --detach ../old <commit>``);
``minivllm/benchmarks/overhead.py`` of the *new* tree is copied into the old one first if it is
missing there, so both are timed by the same instrument. Runs alternate (old, new, old, new ...)
so that a noisy machine hurts both alike; each tree is imported in its own process
(``PYTHONPATH``). The JSON keeps, per tree, its commit and every run's figures (milliseconds per
step, part by part), with the date and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys

SNIPPET = r"""
import argparse, json, sys
from minivllm.benchmarks import overhead
from minivllm.entrypoints import cli
parser = argparse.ArgumentParser()
sub = parser.add_subparsers(dest="command")
overhead.add_parser(sub, cli.add_engine_args)
args = parser.parse_args(["overhead", *sys.argv[1:]])
args.func(args)
"""


def commit_of(tree: str) -> str:
    return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def run_once(tree: str, bench_args: list[str], out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SNIPPET, *bench_args, "--json", out], env=env,
                          capture_output=True, text=True, cwd=tree)
    if done.returncode:
        raise RuntimeError(f"{tree}: {done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-sizes", default="1 16 64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    bench = os.path.join("minivllm", "benchmarks", "overhead.py")
    if not os.path.exists(os.path.join(a.old, bench)):
        shutil.copy(os.path.join(a.new, bench), os.path.join(a.old, bench))
    bench_args = ["--batch-sizes", *a.batch_sizes.split(), "--steps", str(a.steps)]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "command": "python tools/overhead_history.py OLD NEW " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in (("rounds", a.rounds),
                  ("batch_sizes", f"'{a.batch_sizes}'"), ("steps", a.steps))),
              "trees": {}}
    for label, tree in (("old", a.old), ("new", a.new)):
        result["trees"][label] = {"commit": commit_of(tree), "runs": []}
    tmp = os.path.abspath(a.json) + ".part"
    for _ in range(a.rounds):
        for label, tree in (("old", a.old), ("new", a.new)):
            r = run_once(tree, bench_args, tmp)
            result["machine"] = r["machine"]
            result["model"] = r["model"]
            result["trees"][label]["runs"].append(r["by_batch"])
            print(label, {b: round(v["step"], 2) for b, v in r["by_batch"].items()}, flush=True)
    os.remove(tmp)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
