"""The collectives inside compiled graphs: functional (``torch.distributed._functional_collectives``), so dynamo
traces them and Inductor schedules them like any other op. Over a one-rank group each is the identity and adds
nothing to the graph: the tensor-parallel code path at one rank costs what the plain model costs."""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """The ranks of ``group`` (a constant to dynamo)."""
    return dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``t`` over the ranks of ``group``."""
    if group_size(group) == 1:
        return t
    import torch.distributed._functional_collectives as funcol
    return funcol.all_reduce(t, "sum", group)
