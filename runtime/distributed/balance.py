"""Expert load balancing (EPLB) for expert parallelism: where each MoE block's experts and their replicas live.

A placement gives every rank an ordered list of slots ``(expert, replica, replicas)``: the rank holds that expert's
weights and computes the routes to it whose token row ``t`` has ``t % replicas == replica``. An expert with one
replica is computed wholly by its one rank; a hot expert with ``n`` replicas on ``n`` different ranks has its tokens
dealt out among them. Every (token, expert) route is computed by exactly one rank, so the block's all-reduce still
sums the whole output and the tokens do not change.

How it is used: serve with ``expert_parallel=True`` (contiguous experts per rank), read ``Engine.expert_loads()``
(tokens routed to each expert, counted by every MoE block while it runs), ``plan_placement`` those counts with a
number of redundant slots, and start the engine again with ``expert_placement=`` the plan. ``Engine.expert_balance()``
reports the load each rank measured (routes it computed), as max / mean over ranks per block.
"""
from __future__ import annotations

import json
from pathlib import Path

Slot = tuple[int, int, int]  # (expert, replica, replicas)


def contiguous(num_experts: int, world: int) -> list[list[Slot]]:
    """Experts [r E / N, (r + 1) E / N) on rank r, one replica each: expert parallelism's default."""
    return [[(e, 0, 1) for e in range(r * num_experts // world, (r + 1) * num_experts // world)]
            for r in range(world)]


def rank_loads(counts: list[float], placement: list[list[Slot]]) -> list[float]:
    """Routes each rank computes under ``placement`` for these per-expert counts (a replica takes 1 / n of its
    expert's)."""
    return [sum(counts[e] / n for e, _, n in slots) for slots in placement]


def imbalance(loads: list[float]) -> float:
    """max / mean over ranks (1.0 is even); 1.0 for no load at all."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _place(counts: list[float], replicas: list[int], world: int, per_rank: int) -> list[list[Slot]] | None:
    """Replicas to ranks, heaviest first, each to the least-loaded rank with a free slot that does not hold that expert
    yet; None when the slots run out on the ranks an expert may still take."""
    items = sorted(((counts[e] / n, e, j, n) for e, n in enumerate(replicas) for j in range(n)),
                   key=lambda it: (-(it[3] > 1), -it[0], it[1], it[2]))  # replicated experts first: they need spread
    slots: list[list[Slot]] = [[] for _ in range(world)]
    load = [0.0] * world
    for share, e, j, n in items:
        free = [r for r in range(world) if len(slots[r]) < per_rank and all(s[0] != e for s in slots[r])]
        if not free:
            return None
        r = min(free, key=lambda r: (load[r], r))
        slots[r].append((e, j, n))
        load[r] += share
    return [sorted(s) for s in slots]


def plan_placement(counts: list[float], world: int, redundant: int = 0) -> list[list[Slot]]:
    """A placement of ``len(counts)`` experts and ``redundant`` extra replicas over ``world`` ranks, the same number of
    slots on each, that evens the ranks' loads for these counts: each extra replica goes to the expert with the most
    load per replica (at most one replica per rank), then replicas are dealt heaviest first to the least-loaded rank.
    Fewer redundant slots are used when the ranks cannot hold them apart (a multiple of ``world`` at a time)."""
    num = len(counts)
    if world < 1 or num % world:
        raise ValueError(f"{num} experts do not split over {world} ranks")
    if redundant < 0 or redundant % world:
        raise ValueError(f"redundant={redundant}: give a multiple of the {world} ranks (every rank gets as many slots)")
    for extra in range(redundant, -1, -world):
        replicas = [1] * num
        for _ in range(extra):
            e = max((e for e in range(num) if replicas[e] < world), key=lambda e: (counts[e] / replicas[e], -e),
                    default=None)
            if e is None:
                break
            replicas[e] += 1
        placed = _place(counts, replicas, world, (num + extra) // world)
        if placed is not None and sum(map(len, placed)) == num + extra:
            return placed
    return contiguous(num, world)


def check_placement(slots: list[list[Slot]], num_experts: int, world: int, where: str = "") -> None:
    """ValueError unless every route is computed exactly once: each expert's replicas 0..n-1 on n different ranks."""
    if len(slots) != world:
        raise ValueError(f"expert placement{where}: {len(slots)} ranks' slots for {world} ranks")
    seen: dict[int, set[int]] = {}
    counts: dict[int, int] = {}
    for r, own in enumerate(slots):
        experts = [e for e, _, _ in own]
        if len(set(experts)) != len(experts):
            raise ValueError(f"expert placement{where}: rank {r} holds an expert twice")
        for e, j, n in own:
            if not (0 <= e < num_experts and 0 <= j < n):
                raise ValueError(f"expert placement{where}: slot {(e, j, n)} on rank {r} is out of range")
            if counts.setdefault(e, n) != n or j in seen.setdefault(e, set()):
                raise ValueError(f"expert placement{where}: expert {e}'s replicas disagree or repeat")
            seen[e].add(j)
    missing = [e for e in range(num_experts) if len(seen.get(e, ())) != counts.get(e, 1) or e not in seen]
    if missing:
        raise ValueError(f"expert placement{where}: experts {missing[:8]} are not fully placed")


def save(path, placement: dict[str, list[list[Slot]]]) -> None:
    """A placement per MoE block (module path -> slots per rank) as JSON."""
    Path(path).write_text(json.dumps({k: [[list(s) for s in own] for own in v] for k, v in placement.items()}))


def load(path) -> dict[str, list[list[Slot]]]:
    try:
        data = json.loads(Path(path).read_text())
        return {k: [[tuple(int(x) for x in s) for s in own] for own in v] for k, v in data.items()}
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"expert placement {path}: not a placement file written by balance.save ({e})") from e
