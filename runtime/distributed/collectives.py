"""The collectives inside compiled graphs: functional (``torch.distributed._functional_collectives``), so dynamo
traces them and Inductor schedules them like any other op."""
from __future__ import annotations

import torch


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``t`` over the ranks of ``group``."""
    import torch.distributed._functional_collectives as funcol
    return funcol.all_reduce(t, "sum", group)
