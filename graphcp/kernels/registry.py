"""Every kernel graphcp launches, in one registry, with one rule for choosing and checking them.

A ``KernelSpec`` names an op (``attention``, ``kv_write``, ``dsa``, ``rms_norm``, ``rope``,
``fp8_gemm``, ``moe_experts``, ``moe_experts_fp8``, ``delta_rule``, ``delta_state_outputs``), an
implementation, where its function lives (imported on first use, so the engine runs where Triton or
flashinfer is absent), whether a CUDA graph can hold it, and what it cannot serve. ``check`` is the
one start-up test of a compiled kernel against its torch form (one tolerance table);
``KernelChoices`` the layer ops whose Triton form passed its check on a rank (the runner owns it;
models only ask ``chosen``). The choices themselves, with each kernel's check inputs, are in
``kernels/resolve.py``.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import register_dataclass

log = logging.getLogger("graphcp")
Kernel = Callable[..., torch.Tensor]
ATTENTION_CHOICES = ("auto", "flashinfer", "triton", "torch")     # --attention-kernel
# head dims of the Triton paged kernel: padded to a power of two in its tiles (80, 96 -> 128;
# 192 -> 256), so every supported family's full attention runs in it on CUDA
TRITON_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
MLA_MAX_LATENT = 512            # the MLA prefill's [rows, latent] accumulator (kernel report)
DELTA_HEAD_DIMS = (16, 32, 64, 128)    # key head dims of the Triton delta rule
# Relative max error a compiled kernel may show against its torch form at start, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}


@dataclass
class KernelArgs:
    """The device-side arguments of one attention call (host maxima come from the live batch)."""
    q: torch.Tensor              # [T, Hq, D] this rank's queries
    k_pool: torch.Tensor         # [slots, Hkv, D] one layer of the paged cache
    v_pool: torch.Tensor
    cu_seqlens_q: torch.Tensor   # [S + 1] sequences over the query rows
    page_rows: torch.Tensor      # [S, P] page-table row of each sequence
    q_limits: torch.Tensor       # [T] keys each query may see
    out: torch.Tensor            # [T, Hq, D] written in place
    page_size: int
    scale: float
    window: int = 0              # > 0: each query sees only its last ``window`` keys (sliding)
    sinks: torch.Tensor | None = None   # [Hq] per-head sink logits in every row's softmax (gpt-oss)


# A pytree node: a graph break taking KernelArgs gets its tensors resolved at replay like any argument.
register_dataclass(KernelArgs)


@dataclass(frozen=True)
class KernelContext:
    """What a kernel choice depends on."""
    device: torch.device
    dtype: torch.dtype
    head_dim: int = 0
    heads: tuple[int, int] | None = None   # (query, KV) heads on this rank: probe the choice when given
    page_size: int = 16
    bottom_right: bool = True              # False: per-token causal limits (interleave)
    window_or_sinks: bool = False          # layers with a sliding window or attention sinks


@dataclass(frozen=True)
class KernelSpec:
    op: str
    name: str
    module: str                  # where the function lives (imported on first use)
    function: str
    capturable_on_cuda: bool     # every length read from device memory: a CUDA graph can hold it

    @property
    def fn(self) -> Kernel:
        return getattr(importlib.import_module(self.module), self.function)

    def capturable(self, device: torch.device | str | None) -> bool:
        """On CPU every kernel is a break: Triton's interpreter runs numpy, not aten ops."""
        on_cuda = device is not None and torch.device(device).type == "cuda"
        return self.capturable_on_cuda and on_cuda

    def run(self, args: KernelArgs, max_q: int, max_kv: int, workspace: dict | None) -> torch.Tensor:
        return self.fn(args.q, args.k_pool, args.v_pool, args.cu_seqlens_q, args.page_rows, args.q_limits,
                       args.page_size, args.scale, max_q, max_kv, args.out, workspace=workspace,
                       window=args.window, sinks=args.sinks)

    def unsupported_reason(self, ctx: KernelContext) -> str | None:
        """Why this kernel cannot serve ``ctx`` (naming what to change), or None."""
        if self.name == "triton":
            why = triton_unusable(ctx.device)
            if why is not None:
                return why
            if self.op == "attention" and ctx.head_dim not in TRITON_HEAD_DIMS:
                return f"supports head_dim {TRITON_HEAD_DIMS}, the model has {ctx.head_dim}"
            if self.op == "mla_prefill" and ctx.head_dim > MLA_MAX_LATENT:
                return (f"holds a latent row of at most {MLA_MAX_LATENT} in registers, the model "
                        f"has kv_lora_rank {ctx.head_dim}")
            if self.op in DELTA_OPS and ctx.head_dim not in DELTA_HEAD_DIMS:
                return f"supports key head dims {DELTA_HEAD_DIMS}, the model has {ctx.head_dim}"
        if self.name.startswith("flashinfer"):
            fi = importlib.import_module(_FI)
            return fi.unsupported_reason(ctx.device, ctx.dtype, ctx.head_dim, ctx.bottom_right,
                                         ctx.window_or_sinks)
        return None


_FI = "graphcp.kernels.flashinfer_attention"
_K = "graphcp.kernels."
KERNELS = {
    "torch": KernelSpec("attention", "torch", _K + "torch_sdpa", "torch_sdpa_attention", False),
    "triton": KernelSpec("attention", "triton", _K + "triton_attention", "triton_paged_attention", True),
    "flashinfer-trtllm": KernelSpec("attention", "flashinfer-trtllm", _FI, "flashinfer_trtllm_attention", True),
    # The paged wrapper plans on the host: always a break.
    "flashinfer-paged": KernelSpec("attention", "flashinfer-paged", _FI, "flashinfer_paged_attention", False),
}
# The Triton forms of the other ops (their torch forms live beside the code that calls them).
LAYER_KERNELS = {
    "kv_write": KernelSpec("kv_write", "triton", _K + "triton_kv_write", "triton_kv_write", True),
    "dsa": KernelSpec("dsa", "triton", _K + "triton_dsa", "indexer_scores", True),
    "rms_norm": KernelSpec("rms_norm", "triton", _K + "triton_rmsnorm", "triton_rms_norm", True),
    "rope": KernelSpec("rope", "triton", _K + "triton_rope", "triton_rope", True),
    "fp8_gemm": KernelSpec("fp8_gemm", "triton", _K + "triton_fp8_gemm", "triton_fp8_linear", True),
    # per-channel FP8 (compressed-tensors): cuBLASLt's row-wise scaled GEMM, not Triton
    "fp8_rowwise": KernelSpec("fp8_rowwise", "scaled-mm", _K + "fp8_rowwise", "rowwise_linear",
                              True),
    # dense MLA prefill (DeepSeek-V3): absorbed, online softmax over the paged latent rows
    "mla_prefill": KernelSpec("mla_prefill", "triton", _K + "triton_mla", "triton_mla_prefill",
                              True),
    "moe_experts": KernelSpec("moe_experts", "triton", _K + "triton_moe", "triton_experts", True),
    "moe_experts_fp8": KernelSpec("moe_experts_fp8", "triton", _K + "triton_moe",
                                  "triton_experts_fp8", True),
    # Gated DeltaNet's chunked rule and the CP hand-off's state correction (head_dim: dk)
    "delta_rule": KernelSpec("delta_rule", "triton", _K + "triton_delta_rule",
                             "triton_delta_rule", True),
    "delta_state_outputs": KernelSpec("delta_state_outputs", "triton", _K + "triton_delta_rule",
                                      "triton_state_outputs", True),
}
DELTA_OPS = ("delta_rule", "delta_state_outputs")


def kernel_fn(name: str, device: torch.device | str | None = None) -> tuple[Kernel, bool]:
    """(attention kernel function, capturable on ``device``)."""
    spec = KERNELS[name]
    return spec.fn, spec.capturable(device)


# -- the one check ---------------------------------------------------------------------------------
def compare(got: Any, want: Any, dtype: torch.dtype, reference: str = "the torch form") -> str | None:
    """None when every tensor of ``got`` equals ``want``'s within the dtype's tolerance (relative to the
    largest reference value) with the same -inf/+inf/NaN pattern; else the worst error."""
    pairs = list(zip(got, want)) if isinstance(want, (tuple, list)) else [(got, want)]
    worst = 0.0
    for a, b in pairs:
        a, b = a.float().cpu(), b.float().cpu()
        if a.shape != b.shape:
            return f"gives shape {list(a.shape)}, {reference} {list(b.shape)}"
        finite = torch.isfinite(b)
        if not torch.equal(finite, torch.isfinite(a)) or not torch.equal(a[~finite].nan_to_num(),
                                                                       b[~finite].nan_to_num()):
            return f"differs from {reference} where the reference is not finite (masking)"
        if finite.any():
            scale = b[finite].abs().max().clamp_min(1e-6)
            worst = max(worst, float((a[finite] - b[finite]).abs().max() / scale))
    if not worst <= TOLERANCE.get(dtype, 3e-2):
        return f"disagrees with {reference} (max rel err {worst:.2e})"
    return None


def check(run: Callable[[], Any], reference: Callable[[], Any], dtype: torch.dtype,
          reference_name: str = "the torch form") -> str | None:
    """Run a kernel once against its torch form; None when it agrees, else why not (a compile or launch
    failure, or a wrong result)."""
    try:
        got = run()
    except Exception as e:
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return f"failed its first call ({type(e).__name__}: {first})"
    return compare(got, reference(), dtype, reference_name)


def triton_unusable(device: torch.device) -> str | None:
    """Why Triton cannot run on ``device``: CUDA GPUs, and CPU in its interpreter (TRITON_INTERPRET=1,
    which must be set before triton is imported: ``use_triton_interpreter``)."""
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package; install graphcp[test]"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "runs on CPU only in Triton's interpreter: set TRITON_INTERPRET=1 before starting"
    return None if device.type in ("cpu", "cuda") else f"does not run on {device.type}"


def use_triton_interpreter() -> None:
    """Ask for Triton's CPU interpreter (``--attention-kernel triton`` on CPU). The engine calls this at
    start, before anything imports triton; rank processes inherit it."""
    log.warning("graphcp: --attention-kernel triton on CPU runs graphcp's Triton kernels in Triton's "
                "interpreter (numpy, one program at a time): meant for tests, it is 100-1000x slower "
                "than the torch kernels; graph capture alone can take minutes. Leave the flag at "
                "auto to use the torch kernels on CPU.")
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- layer ops whose Triton form passed its check ------------------------------------------------------
class KernelChoices:
    """The Triton forms of layer ops that passed their start-up check on one rank. The runner owns
    one, probes into it at start, and makes it active (``active``) around everything that runs the
    model (eager forwards, graph capture and replay, calibration); layers ask ``chosen``."""

    def __init__(self) -> None:
        self.fns: dict[str, Callable | None] = {}
        self.fallbacks: dict[str, str] = {}    # op -> why its torch form serves (a failed probe)
        self.resolved: dict[str, str] = {}     # attention / DSA kernels resolved to torch on CUDA

    def record(self, op: str, why: str) -> None:
        """A kernel chosen outside ``probe`` (attention ``auto``, the DSA pair) that fell back to its
        torch form on CUDA: a row of the report, not only a log line."""
        self.resolved[op] = f"torch ({why})"

    def probe(self, op: str, run: Callable[[Callable], Any], reference: Callable[[], Any],
              dtype: torch.dtype, head_dim: int = 0) -> bool:
        """Check the Triton form of layer op ``op`` once (at engine start, eagerly, before any
        capture); it serves from then on only if it agrees, else one warning says why and the torch
        form serves. ``head_dim``: the width the op's kernel holds per row, where it has a limit."""
        spec = LAYER_KERNELS[op]
        reason = spec.unsupported_reason(KernelContext(torch.device("cuda"), dtype, head_dim))
        fn = None
        if reason is None:
            try:
                fn = spec.fn
            except ImportError as e:
                reason = f"cannot be imported ({e})"
        if reason is None:
            reason = check(lambda: run(fn), reference, dtype)
        if reason is not None:
            log.warning("graphcp: the Triton %s %s; using the torch form", op, reason)
            self.fallbacks[op] = reason
            fn = None
        else:
            self.fallbacks.pop(op, None)
        self.fns[op] = fn
        return fn is not None

    def report(self) -> dict[str, str]:
        """Each probed op's kernel: "triton", or "torch (<why the Triton form failed>)"."""
        why = self.fallbacks
        ops = {op: "triton" if fn is not None else f"torch ({why.get(op, 'not probed')})"
               for op, fn in self.fns.items()}
        return {**ops, **self.resolved}

    def get(self, op: str) -> Callable | None:
        return self.fns.get(op)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """These choices serve ``chosen`` inside the block; blocks do not nest (one rank runs one
        model at a time)."""
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE is not self:
            raise RuntimeError("another rank's kernel choices are active in this process")
        outer, _ACTIVE = _ACTIVE, self
        try:
            yield
        finally:
            _ACTIVE = outer


_ACTIVE: KernelChoices | None = None


def chosen(op: str) -> Callable | None:
    """The Triton form of ``op`` if the active choices accepted it; None: use the torch form."""
    return _ACTIVE.get(op) if _ACTIVE is not None else None
