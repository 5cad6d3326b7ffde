"""What a run found: part statuses, correctness checks, measurements, and the overall verdict.

A part is ``ok`` (ran everything it plans and raised nothing), ``FAILED`` (raised, crashed, hung, or
was killed at its time limit) or ``INCOMPLETE`` (not run here, not selected, or cut short by its
time budget). The verdict is ``passed`` only when the pre-flight passed, every part is ``ok`` and
every check is within its tolerance; any ``FAILED`` part or failed check makes it ``FAILED``; else
it is ``INCOMPLETE``.
"""
from __future__ import annotations

import time
from typing import Any

OK, FAILED, INCOMPLETE = "ok", "FAILED", "INCOMPLETE"
EXIT_CODES = {"passed": 0, FAILED: 1, INCOMPLETE: 2}
# Dense BF16 tensor-core peak assumed for the H200 (SXM; same GH100 tensor cores as H100 SXM).
PEAK_BF16_TFLOPS = 989.0
LISTS = ("checks", "kernel_perf", "timings", "cp", "fp8_perf", "capture", "kernel_choices")


class Report:
    """One process's results. The driver holds one for the run; each part's child process fills its
    own and hands it back as JSON (``part_result`` / ``merge_part``)."""

    def __init__(self, dry_run: bool, budget_s: float) -> None:
        self.t0 = time.monotonic()
        self.dry_run, self.budget_s = dry_run, budget_s
        self.preflight: list[dict] | None = None   # None: not run
        self.parts: dict[str, dict] = {}
        self.checks: list[dict] = []
        self.kernel_perf: list[dict] = []
        self.timings: list[dict] = []               # prefill latency per shape
        self.cp: list[dict] = []
        self.fp8_perf: list[dict] = []
        self.capture: list[dict] = []               # per-bucket capture time and memory
        self.kernel_choices: list[dict] = []        # per engine: the kernel each op chose, and why
        self.aims: list[dict] = []
        self.info: dict[str, Any] = {}
        self.cuts: list[str] = []                   # work this part left out for its time budget

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    # -- recording -------------------------------------------------------------------------------
    def check(self, part: str, name: str, metric: str, value: float, tol: float,
              **extra: Any) -> None:
        ok = value <= tol                       # NaN is never within tolerance
        self.checks.append({"part": part, "check": name, "metric": metric, "value": value,
                            "tolerance": tol, "ok": ok, **extra})
        print(f"   {'ok  ' if ok else 'FAIL'} {name}: {metric} {value:.3e} (tol {tol:.0e})"
              + "".join(f" {k}={v}" for k, v in extra.items()), flush=True)

    def cut(self, what: str) -> None:
        """Planned work skipped for the time budget: the part ends INCOMPLETE."""
        self.cuts.append(what)
        print(f"   cut for the time budget: {what}", flush=True)

    def aim(self, name: str, measured: float | None, target: float, unit: str) -> None:
        if measured is None:
            status = "n/a"
        elif self.dry_run:
            status = "n/a (dry run)"
        else:
            status = "met" if measured >= target else "not met"
        self.aims.append({"aim": name, "measured": measured, "target": target, "unit": unit,
                          "status": status})

    def set_part(self, key: str, title: str, status: str, note: str, seconds: float = 0.0) -> None:
        self.parts[key] = {"title": title, "status": status, "note": note,
                           "seconds": round(seconds, 1)}

    # -- between processes -----------------------------------------------------------------------
    def part_result(self, status: str, note: str) -> dict:
        if status == OK and self.cuts:
            cut = "cut short: " + "; ".join(self.cuts)
            status, note = INCOMPLETE, f"{note}; {cut}" if note else cut
        return {"status": status, "note": note, "info": self.info,
                **{name: getattr(self, name) for name in LISTS}}

    def merge_part(self, key: str, title: str, result: dict, seconds: float) -> None:
        for name in LISTS:
            getattr(self, name).extend(result.get(name, []))
        self.info.update(result.get("info", {}))
        self.set_part(key, title, result["status"], result["note"], seconds)

    # -- verdict ---------------------------------------------------------------------------------
    def reasons(self) -> tuple[str, list[str]]:
        """(verdict, why) with verdict "passed", FAILED or INCOMPLETE."""
        failed, incomplete = [], []
        for row in self.preflight or []:
            if not row["ok"]:
                failed.append(f"pre-flight: {row['item']}: {row['detail']}")
        if self.preflight is None:
            incomplete.append("the pre-flight did not run")
        for key, p in self.parts.items():
            line = f"part {key}: {p['note'] or p['status']}"
            if p["status"] == FAILED:
                failed.append(line)
            elif p["status"] != OK:
                incomplete.append(line)
        failed += [f"check out of tolerance: {c['part']} {c['check']}"
                   for c in self.checks if not c["ok"]]
        if not self.parts and not failed:
            incomplete.append("no part ran")
        if failed:
            return FAILED, failed + incomplete
        return (INCOMPLETE, incomplete) if incomplete else ("passed", [])

    @property
    def verdict(self) -> str:
        return self.reasons()[0]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict:
        verdict, why = self.reasons()
        return {"dry_run": self.dry_run, "budget_s": self.budget_s,
                "elapsed_s": round(self.elapsed(), 1),
                "peak_bf16_tflops_assumed": PEAK_BF16_TFLOPS, "info": self.info,
                "preflight": self.preflight, "parts": self.parts, "aims": self.aims,
                **{name: getattr(self, name) for name in LISTS},
                "verdict": verdict, "why": why, "failed": verdict == FAILED}
