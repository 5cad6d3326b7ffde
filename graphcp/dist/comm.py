"""Collectives of the forward. gloo cannot live inside a CUDA graph, so there they are graph breaks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from graphcp.graph.capture import graph_break
from graphcp.profiling import nvtx_range


class CPComm:
    """The attention CP group of one rank: the padded K/V all-gather and the last-token reduction."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.capturable = group is not None and dist.get_backend(group) == "nccl"
        self.num_all_gathers = 0
        self.num_all_reduces = 0

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """out [size * n, ...] <- every rank's inp [n, ...], rank-major."""
        return (_all_gather if self.capturable else _all_gather_break)(self, out, inp)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return (_all_reduce if self.capturable else _all_reduce_break)(self, t)


def _staged(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """gloo moves host memory: CUDA tensors (ranks sharing one GPU) go through a host copy."""
    return t.is_cuda and dist.get_backend(group) != "nccl"


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if _staged(out, group):
        host = torch.empty(out.shape, dtype=out.dtype)
        _gather_into(host, inp.cpu().contiguous(), group=group)
        return out.copy_(host)
    _gather_into(out, inp.contiguous(), group=group)
    return out


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if _staged(t, group):
        host = t.cpu()
        dist.all_reduce(host, group=group)
        return t.copy_(host)
    dist.all_reduce(t, group=group)
    return t


def send(t: torch.Tensor, dst: int) -> None:
    dist.send(t.cpu() if _staged(t, None) else t.contiguous(), dst=dst)


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    if _staged(t, None):
        host = torch.empty(t.shape, dtype=t.dtype)
        dist.recv(host, src=src)
        return t.copy_(host)
    dist.recv(t, src=src)
    return t


def _all_gather(comm: CPComm, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    with nvtx_range("all_gather_kv"):
        comm.num_all_gathers += 1
        all_gather_into(out, inp, comm.group)
    return out


def _all_reduce(comm: CPComm, t: torch.Tensor) -> torch.Tensor:
    with nvtx_range("all_reduce"):
        comm.num_all_reduces += 1
        all_reduce(t, comm.group)
    return t


_all_gather_break = graph_break(_all_gather)
# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same semantics); older torch lacks it.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_all_reduce_break = graph_break(_all_reduce)
