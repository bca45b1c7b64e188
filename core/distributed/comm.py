"""The collectives tensor parallelism needs, over torch.distributed.

`device_group` carries activations (NCCL on CUDA, gloo on the CPU); `control_group`
(always gloo) carries rank 0's pickled step messages, so a CUDA run sends its small
host-side metadata without a device round trip.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


class Communicator:
    def __init__(self, rank: int, size: int, device: torch.device, device_group: Any = None,
                 control_group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.device_group = device_group
        self.control_group = control_group
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
        self._length[0] = len(payload)
        dist.broadcast(self._length, src=0, group=self.control_group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.control_group)

    def receive(self) -> Any:
        """Other ranks: the next message rank 0 sent."""
        dist.broadcast(self._length, src=0, group=self.control_group)
        buffer = torch.empty(int(self._length[0]), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.control_group)
        return pickle.loads(buffer.numpy().tobytes())
