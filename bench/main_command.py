"""The README's main command at 1 and at 2 threads: do its figures hold whatever the thread count?

For each thread count (``OMP_NUM_THREADS``), in a fresh folder: fine-tune the toy teacher
(``experiments/finetune_wan.py``), export it, distil it with DMD2 (``experiments/dmd2.py``), exactly as the README
chains them, with ``--eval-prompts N`` more validation prompts on the DMD2 run when asked (the README's 8 give hit
rates in steps of 1/8). Prints each run's validation figures at their first and last step, and checks the last ones
against the ranges the README states (``README_RANGES``): exit status 1 when one falls outside.
Run: ``python bench/main_command.py`` (about 6 minutes on a quiet 2-core machine; 2 threads on 2 busy cores take
several times that).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root, not bench/
from fvx.training import tracking  # noqa: E402

README_RANGES = {  # the README's figures for the last validation on its 8 prompts, one prompt (1/8) either side
    ("finetune_wan", "validation/model/hit_rate"): (0.375, 0.625),
    ("finetune_wan", "validation/model/nearest_mse"): (0.06, 0.08),
    ("dmd2", "validation/student_ema/hit_rate"): (0.0, 0.25),
    ("dmd2", "validation/student_ema/nearest_mse"): (0.06, 0.08),
}
SHOWN = ("hit_rate", "nearest_mse", "prompt_match")


def run(command: list[str], threads: int) -> None:
    """``python -m fvx.run COMMAND`` at ``threads`` threads, from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, "-m", "fvx.run", *command], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)


def chain(folder: pathlib.Path, threads: int, eval_prompts: int | None) -> dict[str, dict[str, list]]:
    """The README's three commands into ``folder``; returns each run's logged validation scalars."""
    teacher = folder / "teacher"
    run(["experiments/finetune_wan.py", "--out", str(folder / "finetune_wan"), "run.progress=false"], threads)
    run(["export", str(folder / "finetune_wan"), "--out", str(teacher)], threads)
    extra = ["run.progress=false"] + ([] if eval_prompts is None else [f"validation.num_prompts={eval_prompts}"])
    run(["experiments/dmd2.py", "--out", str(folder / "dmd2"), f"models.student.path={teacher}",
         f"models.teacher.path={teacher}", *extra], threads)
    return {name: tracking.read_scalars(folder / name / "tb") for name in ("finetune_wan", "dmd2")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="validation prompts of the DMD2 run (default: the experiment's 8)")
    args = parser.parse_args()
    outside = []
    for threads in args.threads:
        with tempfile.TemporaryDirectory() as folder:
            logged = chain(pathlib.Path(folder), threads, args.eval_prompts)
        for name, scalars in logged.items():
            for tag in sorted(t for t in scalars if t.startswith("validation/") and t.endswith(SHOWN)):
                (first_step, first), (last_step, last) = scalars[tag][0], scalars[tag][-1]
                low, high = README_RANGES.get((name, tag), (float("-inf"), float("inf")))
                flag = "" if low <= last <= high else f"  OUTSIDE [{low}, {high}]"
                if flag and args.eval_prompts is None:
                    outside.append(f"{threads} threads: {name} {tag}")
                print(f"{threads} thread(s)  {name:13s} {tag:38s} step {first_step}: {first:.3f}  "
                      f"step {last_step}: {last:.3f}{flag}")
    if outside:
        sys.exit("outside the README's ranges: " + "; ".join(outside))


if __name__ == "__main__":
    main()
