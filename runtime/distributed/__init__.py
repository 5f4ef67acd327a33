"""Running one model over several processes with ``torch.distributed`` (tensor_parallel.py says how it is split)."""
from . import balance
from .tensor_parallel import AllReduced, LocalExperts, ShardReport, TensorParallelError, shard_model

__all__ = ["balance", "AllReduced", "LocalExperts", "RankFailure", "ShardReport", "TensorParallelError", "shard_model", "check_group", "agree",
           "min_over_ranks"]


class RankFailure(RuntimeError):
    """A step failed on this rank of a tensor-parallel engine (its own error, or a collective whose peer is gone).
    The ranks no longer take the same steps, so the engine stops for good: every rank must be started again."""


def check_group(tensor_parallel: int):
    """The process group of ``tensor_parallel`` ranks the engine runs on (the default group), or ValueError saying how
    to start one."""
    import torch.distributed as dist
    how = (f"run the script under `torchrun --nproc-per-node {tensor_parallel}` (or call "
           f"torch.distributed.init_process_group with world_size={tensor_parallel}) and build the Engine on every rank")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"Engine: tensor_parallel={tensor_parallel} needs torch.distributed initialised: {how}")
    if dist.get_world_size() != tensor_parallel:
        raise ValueError(f"Engine: tensor_parallel={tensor_parallel} but the process group has {dist.get_world_size()} "
                         f"ranks: {how}")
    return dist.group.WORLD


def agree(values: list, group=None) -> list:
    """Rank 0's ``values`` on every rank (host-side: sampled tokens, so that every rank's scheduler sees the same)."""
    import torch.distributed as dist
    box = [values]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def min_over_ranks(n: int, group=None) -> int:
    import torch
    import torch.distributed as dist
    t = torch.tensor([n], dtype=torch.long)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
