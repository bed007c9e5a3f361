"""The CPU transport: expert parallelism between processes of a gloo group, through shared memory.

Each rank's buffers are files in /dev/shm that every rank of the group maps
(`torch.from_file(shared=True)`): the CPU counterpart of symmetric memory, with the
same protocol as the GPU transport (write own buffer, barrier, read or write the
peers' buffers, barrier). The files are unlinked as soon as every rank has mapped
them, so nothing is left behind. It exists so that the real schedule, buffer layout
and protocol of the expert-parallel layer run (and are tested) without a GPU.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from . import PeerSlots, PeerTokens, split_source
from .symm import pull_rows, push_rows

SHM_DIR = "/dev/shm"


def _job_id(group, rank: int) -> str:
    """A random id shared by the group (names its /dev/shm files): rank 0's random bytes, broadcast as a
    uint8 tensor (a tensor collective: broadcast_object_list would need numpy)."""
    job = torch.zeros(16, dtype=torch.uint8)
    if rank == 0:
        job = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8)
    dist.broadcast(job, src=dist.get_global_rank(group, 0), group=group)
    return bytes(job.tolist()).hex()


def bounded_barrier(group, timeout: datetime.timedelta) -> None:
    """A barrier of `group` whose wait is bounded by `timeout` on every rank (RuntimeError past it). gloo's
    monitored_barrier bounds only rank 0's wait: the other ranks wait on rank 0 for the process group's
    timeout (30 minutes by default)."""
    dist.barrier(group=group, async_op=True).wait(timeout=timeout)


class SharedMemoryTransport:
    """timeout_s bounds every barrier wait, on every rank (`bounded_barrier`); past it a RuntimeError names the
    ranks that did not arrive, read from a per-rank arrival counter in shared memory."""

    def __init__(self, group, num_tokens: int, top_k: int, *, timeout_s: float = 300.0):
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_tokens, self.top_k = num_tokens, top_k
        self.job = _job_id(group, self.rank)
        self.buffers: dict[tuple, list[torch.Tensor]] = {}
        self.barriers = 0  # barriers this rank has entered; a rank's counter is in its arrival slot
        self.arrivals = None  # [P] views of every rank's int64 arrival counter (set up by the next line)
        self.arrivals = [buffer[0] for buffer in self._peer_buffers("arrivals", 1, 1, torch.int64)]

    def _barrier(self):
        self.barriers += 1
        if self.arrivals is not None:
            self.arrivals[self.rank][0] = self.barriers
        try:
            bounded_barrier(self.group, self.timeout)
        except RuntimeError as error:
            behind = "" if self.arrivals is None else " (ranks that did not arrive: {})".format(
                [r for r in range(self.world_size) if int(self.arrivals[r][0]) < self.barriers])
            raise RuntimeError(
                f"serval.moe: rank {self.rank} of the EP group waited {self.timeout.total_seconds():g} s "
                f"(Config.peer_timeout_s) for the other ranks at a transport barrier{behind}; a rank stopped or "
                f"skipped this layer call ({error})") from error

    def _peer_buffers(self, role: str, rows: int, width: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """[rows, width] buffer of every rank (index = rank), created collectively on first use."""
        key = (role, rows, width, dtype)
        if key not in self.buffers:
            def path(rank):
                name = f"serval-{self.job}-{role}-{rows}x{width}-{dtype}-{rank}".replace("torch.", "")
                return os.path.join(SHM_DIR, name)

            nbytes = rows * width * torch.empty((), dtype=dtype).element_size()
            with open(path(self.rank), "wb") as f:
                f.truncate(nbytes)
            self._barrier()
            self.buffers[key] = [torch.from_file(path(r), shared=True, size=rows * width, dtype=dtype).view(rows, width)
                                 for r in range(self.world_size)]
            self._barrier()
            os.unlink(path(self.rank))  # every rank has mapped it: the mappings outlive the name
        return self.buffers[key]

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        self._barrier()  # a rank that is not here is a bounded, named error, not a collective that waits on
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)

    def pull(self, tokens: torch.Tensor, row_source: torch.Tensor) -> torch.Tensor:
        owner, token, _, _ = split_source(row_source, self.num_tokens, self.top_k)
        buffers = self._peer_buffers("tokens", self.num_tokens, tokens.shape[1], tokens.dtype)

        def read(_source):
            rows = tokens.new_zeros(row_source.shape[0], tokens.shape[1])
            for peer, buffer in enumerate(buffers):
                mine = owner == peer
                rows[mine] = buffer[token[mine]]
            return rows

        return self.pull_into(read, tokens)

    def pull_into(self, consume, tokens: torch.Tensor, *, role: str = "tokens"):
        """See `serval.transport.Transport.pull_into`; the table holds this process's mappings of the peers'
        buffers (Triton kernels read through them under TRITON_INTERPRET=1)."""
        buffers = self._peer_buffers(role, self.num_tokens, tokens.shape[1], tokens.dtype)
        buffers[self.rank].copy_(tokens)
        self._barrier()  # every rank's tokens are in place
        table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        result = consume(PeerTokens(table, self.num_tokens, self.top_k, tokens.shape[1], tokens.dtype, aligned=False))
        self._barrier()  # every rank has read: the buffers may be reused
        return result

    def push(self, rows: torch.Tensor, row_source: torch.Tensor, *, complete: bool = False,
             copy: bool = True) -> torch.Tensor:
        buffers = self._peer_buffers("slots", self.num_tokens * self.top_k, rows.shape[1], rows.dtype)
        owner, _, _, local_source = split_source(row_source, self.num_tokens, self.top_k)
        if not complete:
            buffers[self.rank].zero_()

        def write(_target):
            for peer, buffer in enumerate(buffers):
                mine = owner == peer
                buffer[local_source[mine]] = rows[mine]  # each slot has exactly one writer in the group

        slots = self.push_from(write, rows.shape[1], rows.dtype)
        return slots.clone() if copy else slots

    def read_rows(self, source: PeerTokens, row_source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """See `serval.transport.Transport.read_rows`: the CUDA transport's pull kernel, here in the Triton
        interpreter through this process's mappings (the kernels that take windows run only there on CPU)."""
        return pull_rows(source.table, row_source, source.num_tokens, source.top_k, source.cols, source.dtype,
                         aligned=source.aligned, out=out)

    def write_rows(self, rows: torch.Tensor, row_source: torch.Tensor, target: PeerSlots) -> None:
        """See `serval.transport.Transport.write_rows`: the CUDA transport's push kernel, as `read_rows`."""
        push_rows(target.table, rows, row_source, target.num_slots, aligned=target.aligned)

    def push_from(self, write, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """See `serval.transport.Transport.push_from`; the table holds this process's mappings of the peers'
        buffers (Triton kernels write through them under TRITON_INTERPRET=1)."""
        buffers = self._peer_buffers("slots", self.num_tokens * self.top_k, cols, dtype)
        table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        self._barrier()  # the owners are done with the previous contents (and have zeroed them)
        write(PeerSlots(table, buffers[0].shape[0], cols, dtype, aligned=False))
        self._barrier()  # every row has landed
        return buffers[self.rank]
