"""Running the parts: one child process per part, each under its own time budget, and a hard
watchdog.

A child process per part means a CUDA fault (a sticky illegal-address error poisons the whole
context), a hang in a collective or a crash costs that part only: it is killed with its rank
processes and recorded FAILED with the tail of its output, and the next part starts on a fresh
context. A dry run (CPU, no context to protect) runs the parts in the driver's process.
"""
from __future__ import annotations

import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable

from . import PARTS, Part
from .common import SkipPart
from .report import FAILED, INCOMPLETE, OK, Report

GRACE_S = 8.0            # a child past its budget by this much is killed
MIN_START_FRACTION = 0.5  # a part starts only with this share of its budget left in the run
_current: dict[str, Any] = {}   # the running child, for the watchdog


def title(part: Part | str) -> str:
    if isinstance(part, str):
        part = next(p for p in PARTS if p.key == part)
    return importlib.import_module(f"{__package__}.{part.module}").TITLE


# -- in the child ---------------------------------------------------------------------------------
def child_main(key: str, dry_run: bool, workdir: str, budget_s: float, result_path: str) -> int:
    """Run one part and write its report as JSON; the exit code is 0 whenever the JSON was written.
    """
    part = next(p for p in PARTS if p.key == key)
    module = importlib.import_module(f"{__package__}.{part.module}")
    rep = Report(dry_run, budget_s)
    try:
        note, status = module.run(rep, workdir) or "", OK
    except SkipPart as e:
        status, note = INCOMPLETE, f"not run: {e}"
    except Exception as e:
        status, note = FAILED, f"{type(e).__name__}: {e}".splitlines()[0][:300]
        traceback.print_exc()
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rep.part_result(status, note), f, default=str)
    os.replace(tmp, result_path)
    return 0


# -- in the driver --------------------------------------------------------------------------------
def run_parts(rep: Report, keys: str, driver: str, workdir: str, run_budget_s: float) -> None:
    """Every part in PARTS order; unselected ones are INCOMPLETE (not selected)."""
    for part in PARTS:
        name = title(part)
        if part.key not in keys:
            rep.set_part(part.key, name, INCOMPLETE, "not selected (--parts)")
            continue
        print(f"\n== part {part.key}: {name}", flush=True)
        if part.needs_cuda and rep.dry_run:
            rep.set_part(part.key, name, INCOMPLETE, "not run: needs CUDA (dry run)")
            continue
        left = run_budget_s - rep.elapsed()
        if left < MIN_START_FRACTION * part.budget(rep.dry_run):
            rep.set_part(part.key, name, INCOMPLETE, f"not run: time budget ({left:.0f} s left of "
                         f"the run, part budget {part.budget(rep.dry_run):.0f} s)")
            continue
        budget = min(part.budget(rep.dry_run), left)
        if rep.dry_run:          # no CUDA context to isolate: the parts share this process (one torch import)
            run_here(rep, part, name, workdir, budget)
        else:
            run_child(rep, part, name, driver, workdir, budget)
        p = rep.parts[part.key]
        print(f"   part {part.key}: {p['status']} in {p['seconds']} s"
              + (f" - {p['note']}" if p["note"] else ""), flush=True)


def run_here(rep: Report, part: Part, name: str, workdir: str, budget_s: float) -> None:
    """A dry-run part in the driver's process (the child's code path, without the child)."""
    result = os.path.join(workdir, f"part_{part.key}.json")
    t = time.monotonic()
    child_main(part.key, True, workdir, budget_s, result)
    with open(result) as f:
        rep.merge_part(part.key, name, json.load(f), time.monotonic() - t)


def run_child(rep: Report, part: Part, name: str, driver: str, workdir: str,
              budget_s: float) -> None:
    result = os.path.join(workdir, f"part_{part.key}.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, driver, "--part", part.key, "--workdir", workdir, "--result", result,
           "--budget-s", f"{budget_s:.1f}"] + (["--dry-run"] if rep.dry_run else [])
    t = time.monotonic()
    rep.set_part(part.key, name, FAILED, "still running")     # what the watchdog finds if it fires
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}             # the tail is complete if it is killed
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)   # its own group: its ranks die with it
    tail: collections.deque[str] = collections.deque(maxlen=25)
    reader = threading.Thread(target=_relay, args=(proc, tail), daemon=True)
    reader.start()
    _current.update(proc=proc, key=part.key, t0=t)
    try:
        proc.wait(timeout=budget_s + GRACE_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_group(proc)
        timed_out = True
    finally:
        _current.clear()
    reader.join(timeout=5)
    secs = time.monotonic() - t
    if timed_out:
        rep.set_part(part.key, name, FAILED, f"killed: still running {GRACE_S:.0f} s past its "
                     f"{budget_s:.0f} s budget (a hang?); last output: {_last(tail)}", secs)
    elif os.path.exists(result):
        with open(result) as f:
            rep.merge_part(part.key, name, json.load(f), secs)
    else:
        rep.set_part(part.key, name, FAILED, f"process exited {proc.returncode} without a report "
                     f"(crash or CUDA fault); last output: {_last(tail)}", secs)


def _relay(proc: subprocess.Popen, tail: collections.deque) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        print("   | " + line, end="", flush=True)
        tail.append(line.rstrip())


def _last(tail: collections.deque) -> str:
    lines = [line for line in tail if line.strip()]
    return " / ".join(lines[-3:])[-600:] or "none"


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def start_watchdog(rep: Report, hard_limit_s: float, finish: Callable[[], int]) -> threading.Timer:
    """Past the hard limit: kill the running part, mark what did not finish, write the report, exit.
    """
    def fire() -> None:
        running = dict(_current)
        if running:
            kill_group(running["proc"])
            rep.parts[running["key"]].update(
                status=FAILED, note=f"still running at the hard limit of {hard_limit_s:.0f} s",
                seconds=round(time.monotonic() - running["t0"], 1))
        for part in PARTS:
            if part.key not in rep.parts:
                rep.set_part(part.key, title(part), INCOMPLETE,
                             "not run: the hard limit was reached")
        print(f"\ngpu_check: hard time limit {hard_limit_s:.0f} s reached; writing the partial "
              "report", flush=True)
        try:
            finish()
        finally:
            os._exit(1)

    timer = threading.Timer(max(0.0, hard_limit_s - rep.elapsed()), fire)
    timer.daemon = True
    timer.start()
    return timer
