"""This process's place in a run, and the few collective decisions the loop makes.

Under torchrun the trainer joins the process group itself: NCCL moves gradients on GPUs, gloo on CPU. Control
messages (shard lists, stop flags, metrics, checkpoint state) are small CPU objects, so they always go over a gloo
group, whatever moves the gradients. Without torchrun (WORLD_SIZE unset or 1) every helper here is a no-op.
"""

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shared.errors import ConfigurationError, Eagle3Error

T = TypeVar("T")


@dataclass
class Runtime:
    """This process's place in the run: rank, world size, device, and a gloo group for small control messages."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control_group: dist.ProcessGroup | None = None
    owns_process_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        """Leave the process group after a run that ended on every rank. The ranks meet first and tear down
        together: a rank destroying its group while a peer still finishes can hang at exit (pytorch/pytorch#75097).
        Not after a failure: a peer may be mid-collective, and torchrun stops the others when this rank exits.
        A CPU (gloo) group is left to the process's exit: its destroy still hung one rank after both had passed the
        barrier (the 2-process CPU run, twice in one day); gloo's sockets close with the process."""
        if self.owns_process_group:
            dist.barrier(group=self.control_group)
            if dist.get_backend() != "gloo":
                dist.destroy_process_group()

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is True on any."""
        if not self.distributed:
            return flag
        value = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(value.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.control_group)
        return gathered

    def on_rank0_or_raise(self, make: Callable[[], T]) -> T | None:
        """Run `make` on rank 0 (None elsewhere); if it raises a domain error, every rank raises it, so no rank
        waits forever for a rank that gave up."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = make()
            except Eagle3Error as exc:
                error = exc
        if self.distributed:
            payload: list[Eagle3Error | None] = [error]
            dist.broadcast_object_list(payload, src=0, group=self.control_group)
            error = payload[0]
        if error is not None:
            raise error
        return result


def init_runtime(device: str = "auto") -> Runtime:
    """Join the torchrun process group when there is one (NCCL on GPUs, gloo on CPU)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigurationError("device=cuda but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(torch_device)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Runtime(device=torch_device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=torch_device if use_cuda else None)
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return Runtime(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=torch_device,
        control_group=control,
        owns_process_group=owns,
    )


def end_gloo_rank() -> None:
    """End this process now if it is a rank of a CPU (gloo) run, once the run and its output are done. The gloo group
    is left to the process's exit (Runtime.close), and that exit aborted a rank now and then after both ranks had
    finished ("terminate called without an active exception", SIGABRT, in the 2-process CPU run): gloo's threads
    meet the interpreter's teardown. Leaving without that teardown (no object is left to clean up: the checkpoints
    and the summary are written) exits with 0 every time."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
