"""A `python -m perf` command run in two source trees, base and new, in alternating rounds (base first), each run in
its own process on the same machine: the same benchmark before and after a kernel change, where the anchor in each
run (FlashInfer, vLLM's FA3) shows how much the machine moved between them.

    python -m perf.tools.tree_ab --make-base HEAD              # here: git archive HEAD into .base/ (git-ignored)
    python -m perf.tools.tree_ab --rounds 2 -- zoo --sections decode --no-vllm --configs 128/8/128 --pages 16
    python -m perf.tools.tree_ab -- composable --cells 16x8192x256 --unshared

The new tree is this checkout. The base tree is `--base` (default .base/), which must hold csrc/, fi_backend/
(with the planner extension), perf/ and pyproject.toml. A module built from either tree has its own cache identity,
so one FI_BACKEND_CACHE_DIR serves both. The command gets `--name <name>_<tree>_<k>` (name: --name, default ab), so it
must be one that takes --name (kernels, zoo, composable, ...).
Its JSON is copied to $OUT where that is set, and its output lines are printed with the tree in front. The base
runs' results name the base's commit (its REVISION file); set FI_COMMIT for the new tree's, as for any run on the GPU
machine, whose git may read a stale commit."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE_PARTS = ("csrc", "fi_backend", "perf", "pyproject.toml")
REVISION = "REVISION"   # in the base tree: the commit it was made from


def make_base(rev: str, base: Path) -> None:
    """git archive `rev`'s source parts into `base` (replaced), with this checkout's planner extension."""
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *TREE_PARTS], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
    for so in (ROOT / "fi_backend").glob("_planner*.so"):
        shutil.copy2(so, base / "fi_backend" / so.name)
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    (base / REVISION).write_text(sha + "\n")   # the base runs' results name it (FI_COMMIT): the tree has no git
    print(f"base tree of {rev} ({sha}) in {base}", file=sys.stderr)


def run_tree(tree: str, root: Path, args: list, name: str) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("OUT", None)   # the command writes under its own tree; the JSON is copied to $OUT below
    if (root / REVISION).is_file():
        env["FI_COMMIT"] = (root / REVISION).read_text().strip()
    proc = subprocess.run([sys.executable, "-m", "perf", *args, "--name", name], cwd=root, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        print(f"{tree:4} {line}", flush=True)
    result = root / "perf" / "results" / f"{name}.json"
    out = os.environ.get("OUT")
    if out and result.is_file():
        shutil.copy2(result, Path(out, result.name))
    return proc.returncode


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m perf.tools.tree_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=str(ROOT / ".base"), help="the base tree (default .base/ in this checkout)")
    ap.add_argument("--make-base", metavar="REV", help="write REV's tree into --base and stop (run it here)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each base then new (default 2)")
    ap.add_argument("--name", default="ab", help="results name prefix (default ab)")
    a = ap.parse_args(own)
    base = Path(a.base)
    if a.make_base:
        make_base(a.make_base, base)
        return 0
    if not cmd:
        ap.error("the perf command goes after --, e.g. -- zoo --sections decode")
    missing = [p for p in TREE_PARTS if not (base / p).exists()]
    if missing:
        ap.error(f"--base {base} lacks {', '.join(missing)}; make it with --make-base REV")
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    rc = 0
    for k in range(1, a.rounds + 1):
        for tree, root in (("base", base), ("new", ROOT)):
            print(f"== {tree}, round {k} of {a.rounds}", flush=True)
            rc |= run_tree(tree, root, cmd, f"{a.name}_{tree}_{k}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
