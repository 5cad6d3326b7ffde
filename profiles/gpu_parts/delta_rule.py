"""Part i: the Triton gated delta rule (Qwen3-Next / Qwen3.5 linear attention) against its torch form
on the same inputs: values in bf16 (the rule's TF32 dots) at the released head dims (128), varlen
sequences with initial states and an empty one, the CP hand-off's affine form and its state
correction; then one CUDA graph of the rule replayed on other lengths, and its time beside the
torch form's chunk loop (Triton's interpreter and tiny shapes on a dry run)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .common import cuda_ms, device_of, rel_err

if TYPE_CHECKING:
    import torch

    from .report import Report

TITLE = "Gated DeltaNet Triton rule vs its torch form"


def _inputs(lens: list[int], rows: int, heads: int, dk: int, dv: int, dtype: torch.dtype,
            dev: str, seed: int) -> list[torch.Tensor]:
    """q, k (l2-normalised fp32), v and beta in ``dtype``, g (slow decays) and initial states."""
    import torch

    from graphcp.kernels.delta_rule_torch import l2norm
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(rows, heads, dk, generator=gen)) for _ in range(2))
    v = torch.randn(rows, heads, dv, generator=gen).to(dtype)
    g = -0.1 * torch.rand(rows, heads, generator=gen)
    beta = torch.rand(rows, heads, generator=gen).to(dtype)
    state = torch.randn(len(lens), heads, dk, dv, generator=gen) * 0.1
    return [t.to(dev) for t in (q, k, v, g, beta, state)]


def run(rep: Report, workdir: str) -> str:
    import torch

    from graphcp.kernels import delta_rule_torch as torch_form
    from graphcp.kernels.triton_delta_rule import triton_delta_rule, triton_state_outputs
    dev = device_of(rep)
    dtype = torch.float32 if rep.dry_run else torch.bfloat16
    tol = 1e-4 if rep.dry_run else 2e-2          # TF32 dots against the fp32 torch form
    lens, heads, dk, dv = ([37, 0, 70], 2, 16, 32) if rep.dry_run else \
        ([5000, 0, 77, 3000], 32, 128, 128)
    rows = sum(lens) + 5
    q, k, v, g, beta, state = _inputs(lens, rows, heads, dk, dv, dtype, dev, seed=0)
    lens_t = torch.tensor(lens, device=dev)
    layout = torch_form.ChunkLayout(lens_t, rows, torch_form.chunk_count(lens_t, rows, False))
    name = f"{len(lens)} sequences {lens} h{heads} dk{dk} dv{dv}"
    o, final = triton_delta_rule(q, k, v, g, beta, state, layout)
    ref_o, ref_final = torch_form.gated_delta_rule(q, k, v, g, beta, state, layout)
    rep.check("i", f"delta rule outputs {name}", "max rel err", rel_err(o, ref_o), tol)
    rep.check("i", f"delta rule final states {name}", "max rel err", rel_err(final, ref_final), tol)
    got = torch_form.block_transition(q, k, v, g, beta, layout, triton_delta_rule)
    ref = torch_form.block_transition(q, k, v, g, beta, layout)
    rep.check("i", "CP affine form (o_zero, q_eff, A, B)", "max rel err",
              max(rel_err(a, b) for a, b in zip(got, ref)), tol)
    rep.check("i", "CP state correction q_eff S0", "max rel err",
              rel_err(triton_state_outputs(got[1], state, layout),
                      torch_form.state_outputs(got[1], state, layout)), tol)
    if rep.dry_run:
        return "interpreter, tiny shapes"
    rep.check("i", "CUDA graph of the rule replayed on other lengths", "max rel err",
              _graph_replay(q, k, v, g, beta, state, rows), tol)
    args = (q, k, v, g, beta, state, layout)
    ms = {"triton": cuda_ms(lambda: triton_delta_rule(*args), 2, 5),
          "torch": cuda_ms(lambda: torch_form.gated_delta_rule(*args), 1, 2)}
    rep.info["delta_rule_ms"] = ms | {"tokens": sum(lens), "heads": heads}
    return ", ".join(f"{key} {value:.2f} ms" for key, value in ms.items())


def _graph_replay(q, k, v, g, beta, state, rows: int) -> float:
    """Capture layout + rule once on static buffers (the chunk bound a graph takes), write other
    lengths into the lengths buffer, replay, and compare with an eager torch-form call."""
    import torch

    from graphcp.kernels import delta_rule_torch as torch_form
    from graphcp.kernels.triton_delta_rule import triton_delta_rule
    lens = torch.tensor([rows - 5 - 64, 0, 64, 0], device=q.device)
    bound = torch_form.chunk_count(lens, rows, static=True)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        layout = torch_form.ChunkLayout(lens, rows, bound)
        return triton_delta_rule(q, k, v, g, beta, state, layout)

    step()                                              # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, final = step()
    lens.copy_(torch.tensor([100, 7, rows - 5 - 200, 93], device=q.device))
    graph.replay()
    ref_o, ref_final = torch_form.gated_delta_rule(q, k, v, g, beta, state,
                                                   torch_form.ChunkLayout(lens, rows, bound))
    return max(rel_err(out, ref_o), rel_err(final, ref_final))
