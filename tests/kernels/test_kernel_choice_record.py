"""A CUDA ``auto`` kernel choice that falls back to torch is a row of the kernel-choice report
(``KernelChoices.report()``, ``engine.stats()["kernel_choices"]``), not only a log line. On this
CPU-only machine a "cuda" device makes every Triton check fail for real (no device to run on), which
is exactly the path a failed check on a GPU takes."""
import torch

from graphcp.kernels import dsa_torch
from graphcp.kernels.registry import KernelChoices
from graphcp.kernels.resolve import _dsa_choice, resolve_dsa, resolve_kernel

CUDA = torch.device("cuda")


def test_attention_auto_fallback_is_recorded():
    heard: list[tuple[str, str]] = []
    name = resolve_kernel("auto", CUDA, torch.bfloat16, 128, heads=(4, 2),
                          record=lambda op, why: heard.append((op, why)))
    assert name == "torch"
    assert [op for op, _ in heard] == ["attention"] and heard[0][1]
    heard.clear()
    resolve_kernel("auto", CUDA, torch.bfloat16, 128, heads=(4, 2), window_or_sinks=True,
                   record=lambda op, why: heard.append((op, why)))
    assert [op for op, _ in heard] == ["attention_windowed"]


def test_explicit_torch_and_cpu_auto_record_nothing():
    heard: list = []
    assert resolve_kernel("torch", CUDA, torch.bfloat16, 128, heads=(4, 2),
                          record=lambda *a: heard.append(a)) == "torch"
    assert resolve_kernel("auto", torch.device("cpu"), torch.float32, 128, heads=(4, 2),
                          record=lambda *a: heard.append(a)) == "torch"
    assert heard == []


def test_dsa_fallback_is_recorded_and_reported():
    _dsa_choice.cache_clear()
    choices = KernelChoices()
    assert resolve_dsa("auto", CUDA, choices.record) is dsa_torch
    report = choices.report()
    assert report["dsa"].startswith("torch (") and len(report["dsa"]) > len("torch ()")
    # the CPU default records nothing: torch is the choice there, not a fallback
    choices = KernelChoices()
    assert resolve_dsa("auto", torch.device("cpu"), choices.record) is dsa_torch
    assert "dsa" not in choices.report()
