"""The graphs' static inputs and outputs (``GraphInputs``, owned by the graph runner), built on the batch
descriptors (``forward_batch.Descriptors``).

The graph's static inputs are exactly the raw descriptors; everything else (block sizes, cu_seqlens,
zigzag page table, KV slots, restore indices, positions) is computed from them inside the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.forward_batch import BatchInputs, Descriptors
from graphcp.profiling import active_counter, paused


@dataclass
class GraphInputs:
    """The graphs' static inputs and outputs at fixed addresses, allocated once for the largest bucket
    (mini-sglang's capture buffer): the device descriptors, their host staging copy (pinned on CUDA),
    the logits every replay writes, and the speculative aux rows."""
    static: Descriptors
    staging: Descriptors
    logits: torch.Tensor
    aux: torch.Tensor | None

    @classmethod
    def allocate(cls, req_cap: int, pages_cap: int, ids_cap: int, vocab: int, aux_width: int,
                 aux_dtype: torch.dtype, device: torch.device) -> "GraphInputs":
        static = Descriptors.allocate(req_cap, pages_cap, ids_cap, device)
        staging = Descriptors.allocate(req_cap, pages_cap, ids_cap, "cpu", pin=device.type == "cuda")
        logits = torch.zeros(req_cap, vocab, dtype=torch.float32, device=device)
        # Aux rows of the largest bucket's batch, plus the row that takes padding.
        aux = torch.zeros(ids_cap + 1, aux_width, dtype=aux_dtype, device=device) if aux_width else None
        return cls(static, staging, logits, aux)

    def set_batch(self, batch: BatchInputs) -> None:
        """Write a batch into the staging copy (host work), then copy it in (one host-to-device copy)."""
        with paused(active_counter()):         # filling host memory launches nothing on the device
            self.staging.set(batch, staging=True)
        self.static.packed.copy_(self.staging.packed, non_blocking=True)

    def tensors(self) -> list[torch.Tensor]:
        """Everything a graph reads or writes at a fixed address."""
        return [self.static.packed, self.logits] + ([self.aux] if self.aux is not None else [])
