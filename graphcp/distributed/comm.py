"""Collectives of the forward. NCCL collectives are captured inside CUDA graphs; gloo ones cannot be, so
there they are graph breaks, and CUDA tensors (ranks sharing one GPU) travel through host memory."""
from __future__ import annotations

import torch
import torch.distributed as dist

from graphcp.graph.protocol import collective_point, graph_break
from graphcp.profiling import nvtx_range

# torch 2.13 renamed the tensor forms (same semantics); older torch has only the old names.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nccl(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "nccl"


def _out_of_place(collective, out: torch.Tensor, inp: torch.Tensor,
                  group: dist.ProcessGroup | None) -> torch.Tensor:
    """Run an (out, inp) collective; under gloo, CUDA tensors travel through host memory."""
    collective_point()          # a warmup agrees here that no rank failed (NCCL: not a break)
    if out.is_cuda and not _nccl(group):
        host = torch.empty(out.shape, dtype=out.dtype)
        collective(host, inp.cpu().contiguous(), group=group)
        return out.copy_(host)
    collective(out, inp.contiguous(), group=group)
    return out


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _out_of_place(_gather_into, out, inp, group)


def _reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _out_of_place(_scatter_into, out, inp, group)


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    collective_point()
    if t.is_cuda and not _nccl(group):
        host = t.cpu()
        dist.all_reduce(host, group=group)
        return t.copy_(host)
    dist.all_reduce(t, group=group)
    return t


_all_gather_break = graph_break(_all_gather_into, collective=True)
_reduce_scatter_break = graph_break(_reduce_scatter_into, collective=True)
_all_reduce_break = graph_break(_all_reduce, collective=True)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """out [size * n, ...] <- every rank's inp [n, ...], rank-major."""
    with nvtx_range("all_gather"):
        return (_all_gather_into if _nccl(group) else _all_gather_break)(out, inp, group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """out [n, ...] <- block ``rank`` of the group's sum of every rank's inp [size * n, ...]."""
    with nvtx_range("reduce_scatter"):
        return (_reduce_scatter_into if _nccl(group) else _reduce_scatter_break)(out, inp, group)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over the group."""
    with nvtx_range("all_reduce"):
        return (_all_reduce if _nccl(group) else _all_reduce_break)(t, group)


def send(t: torch.Tensor, dst: int) -> None:
    dist.send(t.cpu() if t.is_cuda and not _nccl(None) else t.contiguous(), dst=dst)


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    if t.is_cuda and not _nccl(None):
        host = torch.empty(t.shape, dtype=t.dtype)
        dist.recv(host, src=src)
        return t.copy_(host)
    dist.recv(t, src=src)
    return t


class CPComm:
    """The attention CP group of one rank: the padded K/V all-gather and the last-token reduction,
    counted so tests can check one K/V collective per layer."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.capturable = group is not None and _nccl(group)
        self.num_all_gathers = 0
        self.num_all_reduces = 0
        self.gathered_bytes: dict[str, int] = {}      # per label: bytes received, summed
        self.gathered_layers: dict[str, int] = {}     # per label: collectives

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, label: str = "full") -> torch.Tensor:
        """``label`` sorts the counted bytes (a sliding-window layer's halo: "sliding")."""
        return (_kv_gather if self.capturable else _kv_gather_break)(self, out, inp, label)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return (_rows_reduce if self.capturable else _rows_reduce_break)(self, t)


# The counters live inside the (break) functions, so a graph replay counts its collectives too.
def _kv_gather(comm: CPComm, out: torch.Tensor, inp: torch.Tensor, label: str) -> torch.Tensor:
    comm.num_all_gathers += 1
    nbytes = out.numel() * out.element_size()
    comm.gathered_bytes[label] = comm.gathered_bytes.get(label, 0) + nbytes
    comm.gathered_layers[label] = comm.gathered_layers.get(label, 0) + 1
    with nvtx_range("all_gather_kv"):
        return _all_gather_into(out, inp, comm.group)


def _rows_reduce(comm: CPComm, t: torch.Tensor) -> torch.Tensor:
    comm.num_all_reduces += 1
    with nvtx_range("all_reduce_last_tokens"):
        return _all_reduce(t, comm.group)


_kv_gather_break = graph_break(_kv_gather, collective=True)
_rows_reduce_break = graph_break(_rows_reduce, collective=True)


class FFNCommunicator:
    """Bridges the attention layout (this rank's CP-local tokens, shared by its attention-TP peers) and the
    FFN layout (every token of the TP world, FFN weights split over the whole TP world).

    gather: all-gather each rank's rows over the TP world, keeping one copy per attention-TP group.
    scatter: reduce-scatter the FFN's partial sums so each rank receives only its own rows, summed."""

    def __init__(self, group: dist.ProcessGroup | None, tp_size: int, attn_tp_size: int, block: int) -> None:
        self.group, self.tp_size, self.attn_tp_size, self.block = group, tp_size, attn_tp_size, block

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = x.new_empty((self.tp_size * rows,) + x.shape[1:])
        all_gather_into(out, x, self.group)
        if self.attn_tp_size == 1:
            return out
        blocks = torch.arange(0, self.tp_size, self.attn_tp_size, device=x.device)
        keep = (blocks[:, None] * rows + torch.arange(rows, device=x.device)[None, :]).reshape(-1)
        return out.index_select(0, keep)

    def scatter(self, partial: torch.Tensor, rows: int) -> torch.Tensor:
        if self.attn_tp_size > 1:   # attention-TP peers share a block: give each rank its own copy to reduce
            partial = partial.view(-1, 1, rows, partial.shape[-1]).expand(-1, self.attn_tp_size, -1, -1)
            partial = partial.reshape(-1, partial.shape[-1])
        out = partial.new_empty((rows, partial.shape[-1]))
        return reduce_scatter_into(out, partial, self.group)
