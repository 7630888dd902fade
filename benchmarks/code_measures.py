"""How large and how branchy the step's code is, at git revisions side by side.

    .venv/bin/python benchmarks/code_measures.py [REV ...]     (default: b0edbbc HEAD)

For each revision, read from git (the work tree is not touched):
  trainer lines      lines of vlrl/trainer/*.py, and of ppo_trainer.py alone
  step-path ifs      `if` statements and conditional expressions in the driver's functions a
                     training step runs through (PPOTrainer.train_step and what it calls on the
                     driver, whichever module they live in at that revision; found by name)
  step-path funcs    how many such functions there are
  RankWorker roles   comparisons of `self.role` in vlrl/workers/rank_worker.py
  hops to the loss   calls from `PPOTrainer.train_step` to the policy loss: the first chain of
                     CHAINS below (named by hand) whose functions all exist at the revision
"""

from __future__ import annotations

import ast
import subprocess
import sys

# The driver's step path: functions by (class or module-level) name; missing ones are skipped.
STEP_FUNCTIONS = {
    "PPOTrainer": ["train_step", "_generate_scored_batch", "_recorded", "_draw_round", "_take_prefetched",
                   "_generate_and_score", "_generate", "_submit_generate", "_engine_inputs", "_merge", "_score",
                   "_remax_baselines", "_take_rows", "_advantages", "_outcome_advantages"],
    "BatchFiller": ["fill"],
    "EngineCalls": ["submit", "merge", "generate", "generate_scored", "score"],
    "SynchronousRounds": ["round"],
    "PrefetchedRounds": ["round", "_take"],
    "GreedyBaseline": ["baselines"],
    "AsyncRollout": ["take", "next_steps", "submit", "sync_engines", "wait_for_receive"],
}  # fmt: skip
STEP_MODULES = ["vlrl/trainer/ppo_trainer.py", "vlrl/trainer/rounds.py", "vlrl/trainer/sources.py",
                "vlrl/trainer/async_rollout.py"]  # fmt: skip
# From the step to the PPO loss, in-process (under Ray the update call crosses to the rank's
# process): the first chain whose functions all exist at the revision is counted.
CHAINS = [
    [("vlrl/trainer/ppo_trainer.py", "train_step"), ("vlrl/workers/rank_worker.py", "update"),
     ("vlrl/workers/training_side.py", "update"), ("vlrl/workers/actor.py", "update_policy"),
     ("vlrl/workers/actor.py", "forward_backward"), ("vlrl/algorithms/losses.py", "compute_policy_loss")],
    [("vlrl/trainer/ppo_trainer.py", "train_step"), ("vlrl/workers/rank_worker.py", "update"),
     ("vlrl/workers/actor.py", "update_policy"), ("vlrl/workers/actor.py", "forward_backward"),
     ("vlrl/algorithms/losses.py", "compute_policy_loss")],
]  # fmt: skip


def source(rev: str, path: str) -> str | None:
    done = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def trainer_lines(rev: str) -> tuple[int, int]:
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}", "vlrl/trainer/"],
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    total = sum(len((source(rev, n) or "").splitlines()) for n in names if n.endswith(".py"))
    return total, len((source(rev, "vlrl/trainer/ppo_trainer.py") or "").splitlines())


def step_path_ifs(rev: str) -> tuple[int, int]:
    ifs = functions = 0
    for path in STEP_MODULES:
        text = source(rev, path)
        if text is None:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name in STEP_FUNCTIONS:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name in STEP_FUNCTIONS[node.name]:
                        functions += 1
                        ifs += sum(isinstance(n, (ast.If, ast.IfExp)) for n in ast.walk(item))
    return ifs, functions


def role_comparisons(rev: str) -> int:
    tree = ast.parse(source(rev, "vlrl/workers/rank_worker.py") or "")
    return sum(
        isinstance(n, ast.Compare)
        and any(
            isinstance(s, ast.Attribute) and s.attr == "role" for s in [n.left, *n.comparators]
        )  # fmt: skip
        for n in ast.walk(tree)
    )


def hops(rev: str) -> str:
    for chain in CHAINS:
        if all(f"def {name}(" in (source(rev, path) or "") for path, name in chain):
            return str(len(chain) - 1)
    return "?"


def main() -> None:
    revs = sys.argv[1:] or ["b0edbbc", "HEAD"]
    print(f"{'revision':<10}{'trainer lines':>15}{'ppo_trainer':>13}{'step-path ifs':>15}{'funcs':>7}"
          f"{'role ==':>9}{'hops':>6}")  # fmt: skip
    for rev in revs:
        total, ppo = trainer_lines(rev)
        ifs, functions = step_path_ifs(rev)
        print(f"{rev:<10}{total:>15}{ppo:>13}{ifs:>15}{functions:>7}{role_comparisons(rev):>9}{hops(rev):>6}")


if __name__ == "__main__":
    main()
