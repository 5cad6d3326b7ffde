"""The parts of ``profiles/gpu_check.py``, one module each, in the order they run: most informative
first.

f shows whether graph breaks read stale inputs from a dirty pool, a and c whether the kernels and
the graphs are right at all, d whether CP is, h whether each family is (through the engine); g and
e check the DSA, MoE and FP8 kernels, i the Gated DeltaNet rule; b only measures. Each part runs in
its own process under its own time budget (seconds on the GPU, and on a dry run).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    key: str
    module: str            # gpu_parts.<module> holds TITLE and run(report, workdir) -> note
    budget_s: float        # the part is killed a few seconds past this (its checks stop before)
    dry_budget_s: float
    needs_cuda: bool = False   # nothing to run on a dry run

    def budget(self, dry_run: bool) -> float:
        return self.dry_budget_s if dry_run else self.budget_s


# GPU budgets sum to 440 s of the run's 455 (the pre-flight takes the rest). Dry-run budgets are
# wide (about 40 s in all on an idle 2-core machine, 4 minutes on a crowded one): a CI run is not cut.
# h's 70 s and i's 25 s came from c, d, b and the kernel parts (estimate in profiles/README.md):
# what does not fit is cut (INCOMPLETE), never run past the budget.
PARTS = (Part("f", "dirty_pool", 45, 90), Part("a", "kernels", 55, 60),
         Part("c", "model", 100, 180), Part("d", "cp", 60, 180), Part("h", "families", 70, 240),
         Part("g", "dsa_moe", 30, 45), Part("e", "fp8", 25, 45), Part("i", "delta_rule", 25, 60),
         Part("b", "attention_perf", 30, 5, needs_cuda=True))
PART_KEYS = "".join(p.key for p in PARTS)
