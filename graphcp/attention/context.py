"""What one forward's attention ops share: the rank's pool, the batch's CP metadata and host maxima,
the CP collectives, and the kernels chosen at start. The runner builds it once per forward; each layer
kind's op reads it (``attention/kinds.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from graphcp.cp.metadata import CPMetadata, HostMaxima, LastTokens
from graphcp.distributed.comm import CPComm
from graphcp.kernels.registry import KernelSpec
from graphcp.kv.cache import PagedPool
from graphcp.models.config import ModelConfig


@dataclass(frozen=True)
class AttentionKernels:
    """Chosen once at start (``graphcp.attention.build``)."""
    attention: KernelSpec        # the paged varlen kernel of the dense layers
    split_early_late: bool       # the flashattention path: one call for the early blocks, one for the late
    dsa: ModuleType | None       # ``indexer_scores`` / ``sparse_mla`` (Triton or the torch forms)
    # the kernel of layers with a sliding window or attention sinks, and why it is not ``attention``
    windowed: KernelSpec | None = None
    windowed_reason: str | None = None

    def kernel(self, window: int, sinks: bool) -> KernelSpec:
        return self.windowed if (window or sinks) and self.windowed is not None else self.attention


@dataclass
class AttentionContext:
    cfg: ModelConfig
    pool: PagedPool
    meta: CPMetadata
    comm: CPComm | None
    host: HostMaxima
    kernels: AttentionKernels
    last: LastTokens | None = None   # the last layer attends for each request's last token only

    def all_gather(self, rows):
        """``rows`` of every CP rank, rank-major (one collective; the rows themselves at CP 1)."""
        if self.meta.cp_size == 1:
            return rows
        out = rows.new_empty((self.meta.cp_size * rows.shape[0],) + tuple(rows.shape[1:]))
        return self.comm.all_gather(out, rows.contiguous())
