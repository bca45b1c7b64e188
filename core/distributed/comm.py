"""The collectives tensor parallelism needs, over torch.distributed, and the channel rank
0's step messages travel on.

Activations go through the default process group (NCCL on CUDA, gloo on the CPU), whose
timeout bounds how long a rank waits for a stuck peer. Step messages must not time out
while the engine sits idle, so they travel apart: over a socket to each worker the engine
started (`SocketChannel`), or, under torchrun, over a gloo group whose timeout is a year.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

import torch
import torch.distributed as dist

_HEADER = struct.Struct("<Q")


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame, or None when the other end has closed."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    payload = _recv_exactly(sock, _HEADER.unpack(header)[0])
    return payload


def _recv_exactly(sock: socket.socket, count: int) -> bytes | None:
    buffer = bytearray(count)
    view = memoryview(buffer)
    received = 0
    while received < count:
        chunk = sock.recv_into(view[received:])
        if not chunk:
            return None
        received += chunk
    return bytes(buffer)


class SocketChannel:
    """Rank 0's step messages over one socket per worker (rank 0 holds all of them)."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self.sockets = sockets

    def send(self, payload: bytes) -> None:
        for sock in self.sockets:
            send_frame(sock, payload)

    def receive(self) -> bytes | None:
        return recv_frame(self.sockets[0])


class Communicator:
    def __init__(self, rank: int, size: int, device: torch.device, device_group: Any = None,
                 control_group: Any = None, channel: SocketChannel | None = None) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.device_group = device_group
        self.control_group = control_group
        self.channel = channel
        self._length = torch.zeros(1, dtype=torch.int64)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def gather_columns(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """Rank 0: every rank's [R, C] shard side by side, cut to `width` columns; other
        ranks: an empty [R, 0] tensor."""
        tensor = tensor.contiguous()
        if self.rank == 0:
            shards = [torch.empty_like(tensor) for _ in range(self.size)]
            dist.gather(tensor, shards, dst=0, group=self.device_group)
            return torch.cat(shards, dim=1)[:, :width]
        dist.gather(tensor, None, dst=0, group=self.device_group)
        return tensor[:, :0]

    def send(self, message: Any) -> None:
        """Rank 0: broadcast a picklable message to every other rank."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if self.channel is not None:
            self.channel.send(payload)
            return
        self._length[0] = len(payload)
        dist.broadcast(self._length, src=0, group=self.control_group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.control_group)

    def receive(self) -> Any:
        """Other ranks: the next message rank 0 sent; ("stop", None) once rank 0 has gone."""
        if self.channel is not None:
            payload = self.channel.receive()
            return ("stop", None) if payload is None else pickle.loads(payload)
        dist.broadcast(self._length, src=0, group=self.control_group)
        buffer = torch.empty(int(self._length[0]), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.control_group)
        return pickle.loads(buffer.numpy().tobytes())
