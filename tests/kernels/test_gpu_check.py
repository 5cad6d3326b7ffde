"""profiles/gpu_check.py cannot pass vacuously, and says why it stops: no CUDA, a part skipped for
the time budget, cut short, hung or crashed, and what Triton needs to build its launcher (hidden
here by monkeypatching the lookups). Also the NVML reading mapped by PCI bus id, never by CUDA
index. Fast: the full dry run is in test_profiling.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from gpu_parts import PARTS, Part, families, orchestrate, preflight
from gpu_parts.report import FAILED, INCOMPLETE, OK, Report
from testkit.paths import REPO

from graphcp import profiling

PROFILES = os.path.join(REPO, "profiles")
DRIVER = os.path.join(PROFILES, "gpu_check.py")


def _run_driver(*args: str, tmp_path) -> tuple[subprocess.CompletedProcess, dict, str]:
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_HUB_OFFLINE", None)                # the driver sets it itself
    proc = subprocess.run([sys.executable, DRIVER, "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    return proc, report, (tmp_path / "gpu_check.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without CUDA")
def test_without_cuda_the_check_fails_and_says_why(tmp_path):
    proc, report, md = _run_driver(tmp_path=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torch.cuda.is_available() is False" in proc.stderr and "CUDA device" in proc.stderr
    assert report["verdict"] == FAILED and report["why"][0].startswith("pre-flight: CUDA device")
    assert {p["status"] for p in report["parts"].values()} == {INCOMPLETE}
    assert not report["checks"] and "**Overall: FAILED**" in md and "passed" not in md


def test_a_part_skipped_for_the_time_budget_is_incomplete(tmp_path):
    proc, report, md = _run_driver("--dry-run", "--budget-s", "1", "--parts", "a",
                                   tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert report["parts"]["a"]["status"] == INCOMPLETE
    assert report["parts"]["a"]["note"].startswith("not run: time budget")
    assert report["parts"]["c"]["note"] == "not selected (--parts)"
    assert report["verdict"] == INCOMPLETE and "**Overall: INCOMPLETE**" in md
    assert "part a: not run: time budget" in md


def _report_with(statuses: dict[str, str]) -> Report:
    rep = Report(dry_run=False, budget_s=100)
    rep.preflight = [{"item": "CUDA device", "found": True, "needed": True, "ok": True,
                      "detail": ""}]
    for key, status in statuses.items():
        rep.set_part(key, key, status, "")
    return rep


def test_verdict_passes_only_when_everything_ran_and_passed():
    assert _report_with({"a": OK, "b": OK}).verdict == "passed"
    assert _report_with({"a": OK}).exit_code == 0
    assert _report_with({"a": OK, "b": INCOMPLETE}).exit_code == 2
    assert _report_with({"a": FAILED, "b": INCOMPLETE}).exit_code == 1
    rep = _report_with({"a": OK})
    rep.check("a", "x", "err", float("nan"), 1.0)                # NaN is never within tolerance
    assert rep.verdict == FAILED
    rep = _report_with({})
    assert rep.verdict == INCOMPLETE and rep.reasons()[1] == ["no part ran"]
    rep = _report_with({"a": OK})
    rep.preflight = None
    assert rep.verdict == INCOMPLETE


def test_run_parts_skips_what_the_budget_cannot_fit(monkeypatch):
    ran = []
    monkeypatch.setattr(orchestrate, "run_child", lambda rep, part, name, driver, workdir, budget: (
        ran.append((part.key, budget)), rep.set_part(part.key, name, OK, "")))
    rep = Report(dry_run=False, budget_s=100)
    rep.t0 -= 360                                 # 360 s into a 400 s run: 40 s left
    orchestrate.run_parts(rep, "fcb", "driver", "workdir", run_budget_s=400)
    assert [k for k, _ in ran] == ["f", "b"]      # c needs half its 110 s budget: not started
    assert 39 < ran[0][1] <= 40 and ran[1][1] == 30     # f (45 s) is capped by what is left
    assert rep.parts["c"]["status"] == INCOMPLETE and "time budget" in rep.parts["c"]["note"]
    assert rep.parts["a"]["note"] == "not selected (--parts)"
    assert list(rep.parts) == [p.key for p in PARTS]   # reported in run order, dirty pool first
    assert PARTS[0].key == "f"


def test_a_part_cut_short_reports_incomplete(monkeypatch, tmp_path):
    fake = types.ModuleType("gpu_parts.fake_part")
    fake.TITLE = "fake"

    def run(rep: Report, workdir: str) -> str:
        rep.check("z", "first case", "err", 0.0, 1e-3)
        rep.cut("cases 2 and 3")
        return "ran one case"

    fake.run = run
    monkeypatch.setitem(sys.modules, "gpu_parts.fake_part", fake)
    monkeypatch.setattr(orchestrate, "PARTS", (Part("z", "fake_part", 10, 10),))
    result = tmp_path / "z.json"
    assert orchestrate.child_main("z", True, str(tmp_path), 10, str(result)) == 0
    data = json.loads(result.read_text())
    assert data["status"] == INCOMPLETE and "cut short: cases 2 and 3" in data["note"]
    assert data["checks"][0]["ok"]
    rep = Report(dry_run=True, budget_s=10)
    rep.merge_part("z", "fake", data, 1.0)
    assert rep.parts["z"]["status"] == INCOMPLETE and rep.checks


@pytest.mark.parametrize("script, expect", [
    ("import time; time.sleep(60)", "killed: still running"),
    ("import sys; sys.exit(3)", "exited 3 without a report")])
def test_a_hung_or_crashed_part_is_failed(monkeypatch, tmp_path, script, expect):
    driver = tmp_path / "fake_driver.py"
    driver.write_text(script)
    monkeypatch.setattr(orchestrate, "GRACE_S", 0.5)
    rep = Report(dry_run=True, budget_s=10)
    orchestrate.run_child(rep, Part("z", "none", 1, 1), "fake", str(driver), str(tmp_path), 1.0)
    assert rep.parts["z"]["status"] == FAILED and expect in rep.parts["z"]["note"]
    assert rep.parts["z"]["seconds"] < 10


def test_the_indexer_check_catches_scores_left_past_the_causal_limit():
    from gpu_parts.dsa_moe import _neg_inf_mismatch

    from graphcp.kernels import dsa_torch
    gen = torch.Generator().manual_seed(0)
    q, keys = torch.randn(3, 2, 8, generator=gen), torch.randn(10, 8, generator=gen)
    limits = torch.tensor([4, 7, 10])
    slots, rows = torch.arange(10).view(1, 10), torch.zeros(3, dtype=torch.long)
    want = dsa_torch.indexer_scores(q, torch.rand(3, 2, generator=gen), keys, slots, rows, limits)
    assert _neg_inf_mismatch(want.clone(), want) == 0
    leaked = torch.where(torch.isneginf(want), torch.zeros_like(want), want)     # 0, not -inf
    assert _neg_inf_mismatch(leaked, want) == 6 + 3                              # every masked one
    nan = want.clone()
    nan[2, 0] = float("nan")
    assert _neg_inf_mismatch(nan, want) == 1


def test_the_check_modules_stay_small():
    dirs = (PROFILES, os.path.join(PROFILES, "gpu_parts"))
    sizes = {f: sum(1 for _ in open(os.path.join(d, f))) for d in dirs
             for f in os.listdir(d) if f.endswith(".py")}
    assert len(sizes) >= 10 and max(sizes.values()) <= 400, sizes


# -- the pre-flight --------------------------------------------------------------------------
@pytest.fixture
def bare_machine(monkeypatch, tmp_path):
    """No compiler, no Python.h, no libcuda anywhere Triton or the pre-flight looks."""
    for var in ("CC", "TRITON_LIBCUDA_PATH", "LD_LIBRARY_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    (tmp_path / "include").mkdir()
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(preflight, "python_include_dir", lambda: str(tmp_path / "include"))
    monkeypatch.setattr(preflight, "ldconfig_listing", lambda: "")
    monkeypatch.setattr(preflight, "USUAL_LIBCUDA_DIRS", (str(tmp_path / "lib"),))
    return tmp_path


def test_preflight_names_each_missing_piece(bare_machine):
    rows = {r["item"]: r for r in preflight.run_preflight(dry_run=False)}
    assert "no C compiler" in rows["C compiler"]["detail"] and not rows["C compiler"]["ok"]
    header = rows["Python.h"]["detail"]
    assert "Python.h does not exist" in header and "-dev" in header
    assert "libcuda.so.1 not found" in rows["libcuda.so.1"]["detail"]
    assert rows["tiny Triton kernel"]["detail"].startswith("not tried")
    message = preflight.stop_message(list(rows.values()))
    assert message.startswith("gpu_check: stopping before any part")
    for item in ("C compiler", "Python.h", "libcuda.so.1", "tiny Triton kernel"):
        assert f"  - {item}: " in message


def test_preflight_lookups_follow_triton(bare_machine, monkeypatch):
    lib = bare_machine / "lib"
    (lib / "libcuda.so.1").write_text("")
    found, detail = preflight.find_libcuda()          # on disk, but ldconfig does not list it
    assert not found and f"export TRITON_LIBCUDA_PATH={lib}" in detail
    monkeypatch.setattr(preflight, "ldconfig_listing",
                        lambda: f"\tlibcuda.so.1 (libc6,x86-64) => {lib}/libcuda.so.1\n")
    assert preflight.find_libcuda()[0]
    monkeypatch.setattr(preflight, "ldconfig_listing", lambda: None)   # /sbin/ldconfig cannot run
    assert "cannot run" in preflight.find_libcuda()[1]
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(lib))
    assert preflight.find_libcuda() == (True, f"$TRITON_LIBCUDA_PATH={lib}")
    monkeypatch.setenv("CC", "no-such-cc")
    assert not preflight.find_c_compiler()[0]
    monkeypatch.delenv("CC")
    monkeypatch.setattr(preflight.shutil, "which",
                        lambda name: "/usr/bin/cc" if name == "cc" else None)
    found, detail = preflight.find_c_compiler()       # Triton never tries plain cc by itself
    assert not found and "export CC=/usr/bin/cc" in detail
    (bare_machine / "include" / "Python.h").write_text("")
    assert preflight.find_python_h()[0]


def test_preflight_on_a_dry_run_needs_only_triton(bare_machine, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = preflight.run_preflight(dry_run=True)
    assert preflight.stop_message(rows) is None
    kernel = rows[-1]
    assert kernel["item"] == "tiny Triton kernel" and kernel["found"], kernel
    assert not next(r for r in rows if r["item"] == "C compiler")["found"]      # shown, not needed


# -- NVML by PCI bus id ----------------------------------------------------------------------
class _FakeNVMLError(Exception):
    pass


@pytest.fixture
def two_gpus(monkeypatch):
    """CUDA sees the GPUs at buses 3B and 86 as devices 0 and 1; NVML numbers them the other way."""
    handles = {"00000000:3B:00.0": "gpu-3b", "00000000:86:00.0": "gpu-86"}
    used = {"gpu-3b": 30 << 30, "gpu-86": 80 << 30}

    def by_bus(bus_id: str) -> str:
        if bus_id.upper() not in handles:
            raise _FakeNVMLError("not found")
        return handles[bus_id.upper()]

    fake = types.SimpleNamespace(
        NVMLError=_FakeNVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByPciBusId=by_bus,
        nvmlDeviceGetHandleByIndex=["gpu-86", "gpu-3b"].__getitem__,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=used[h], total=141 << 30))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    props = [types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0),
             types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x86, pci_device_id=0)]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    return fake


def test_nvml_reading_maps_the_device_by_bus_id(two_gpus, monkeypatch):
    assert profiling.gpu_memory_used(torch.device("cuda", 0)) == 30 << 30
    assert profiling.gpu_memory_used(torch.device("cuda", 1)) == 80 << 30
    assert profiling.gpu_memory_used(torch.device("cuda")) == 80 << 30       # the current device
    unknown = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x11, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: unknown)
    assert profiling.gpu_memory_used(torch.device("cuda", 0)) is None     # a bus NVML does not know


def test_nvml_without_a_driver_or_package(two_gpus, monkeypatch):
    def no_driver() -> None:
        raise _FakeNVMLError("Driver Not Loaded")

    monkeypatch.setattr(two_gpus, "nvmlInit", no_driver)
    assert profiling.gpu_memory_used(torch.device("cuda", 0)) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)                         # not installed
    assert profiling.gpu_memory_used(torch.device("cuda", 0)) is None


def test_per_bucket_memory_is_this_process_not_the_device(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 << 30)
    assert profiling.process_memory(torch.device("cuda", 1)) == 5 << 30     # NVML would say 80 GiB
    assert profiling.process_memory(torch.device("cpu")) > 0                 # resident memory


# -- part h: a tiny engine per family; part f: the dirtied pool ------------------------------------
def test_per_row_error_sees_a_wrong_far_row():
    """A request whose logits are small is wrong by half its own scale: the batch-wide relative
    error (and a 2e-2 absolute tolerance) pass it, the per-row error does not."""
    from gpu_parts.common import rel_err
    from gpu_parts.families import row_rel_err
    want = torch.stack([torch.linspace(-100, 100, 50), torch.linspace(-0.01, 0.01, 50)])
    got = want.clone()
    got[1, -1] += 0.005
    assert rel_err(got, want) < 1e-4 and (got - want).abs().max() < 2e-2
    assert row_rel_err(got, want) == pytest.approx(0.5)


@pytest.fixture(scope="module")
def family_workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("family", [f.name for f in families.FAMILIES])
def test_each_family_case_runs_on_cpu(family, family_workdir):
    """Each family's case through the engine (graphs, CP, EP, FP8 as on the GPU) against its fp32
    reference, per row: every check within tolerance, the kernels recorded."""
    fam = next(f for f in families.FAMILIES if f.name == family)
    rep = Report(dry_run=True, budget_s=600)
    families.run_family(rep, fam, family_workdir, 1e-4)
    assert rep.checks and all(c["ok"] for c in rep.checks), rep.checks
    assert rep.checks[0]["value"] <= 1e-4 and rep.checks[0]["metric"] == "worst row rel err"
    assert rep.kernel_choices[0]["engine"] == family and rep.kernel_choices[0]["attention"]


def test_a_wrong_family_result_fails(family_workdir, monkeypatch):
    """One request's logits off by 1e-3 of its row (the engine's output, not the reference's): the
    family check fails."""
    real = families._logits

    def wrong_case(args, batch, force_eager):
        logits, stats, out = real(args, batch, force_eager)
        if not force_eager:              # the case, not its reference
            logits = logits.clone()
            logits[-1] += 1e-3 * logits[-1].abs().max()
        return logits, stats, out

    monkeypatch.setattr(families, "_logits", wrong_case)
    rep = Report(dry_run=True, budget_s=600)
    fam = next(f for f in families.FAMILIES if f.name.startswith("FP8 dense"))
    families.run_family(rep, fam, family_workdir, 1e-4)
    assert not rep.checks[0]["ok"] and rep.checks[0]["value"] == pytest.approx(1e-3, rel=0.05)


def test_dirty_pool_part_dirties_the_pool(tmp_path):
    """Part f sets every byte of the replay pool to 0xFF (NaN) before each replay, reads it back,
    and the graphs still equal eager."""
    from gpu_parts import dirty_pool
    rep = Report(dry_run=True, budget_s=600)
    dirty_pool.run(rep, str(tmp_path))
    dirtied = [c for c in rep.checks if c["check"].startswith("graph pool dirtied")]
    assert len(dirtied) == 2 and all(c["ok"] and c["pool_bytes"] > 0 for c in dirtied)
    assert all(c["ok"] for c in rep.checks), rep.checks


def test_a_failed_probe_is_recorded_not_only_logged():
    """A Triton layer op whose start-up probe fails serves in its torch form, and the choices say
    so, with the reason (the engine's stats and gpu_check's report read ``report``)."""
    from graphcp.kernels.registry import KernelChoices

    def raising(fn):
        raise RuntimeError("no kernel image for sm_90a")

    choices = KernelChoices()
    x = torch.randn(4, 8)
    assert not choices.probe("rope", raising, lambda: x, torch.float32)
    assert choices.probe("rms_norm", lambda fn: (x * 2, x), lambda: (x * 2, x), torch.float32)
    report = choices.report()
    assert report["rms_norm"] == "triton"
    assert report["rope"] == ("torch (failed its first call (RuntimeError: no kernel image for "
                              "sm_90a))")
    assert choices.probe("rope", lambda fn: x, lambda: x, torch.float32)
    assert choices.report()["rope"] == "triton"
