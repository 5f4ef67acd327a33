"""Cache bookkeeping, plain Python (no tensors): paged blocks for attention/latent caches and compact rows
for SSM state buffers."""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Fixed-size pages of the paged caches. Block 0 is reserved: padding rows write there and never read it
    back, so no sequence can ever see another one's keys through padding."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 cache blocks (one is reserved), got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._is_free = bytearray([0] + [1] * (num_blocks - 1))  # a block is freed once per allocation

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._is_free[b] = 0
        return out

    def free(self, blocks: list[int]) -> None:
        bad = any(b <= 0 or b >= self.num_blocks or self._is_free[b] for b in blocks)
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"freeing invalid blocks {blocks} (block 0 is reserved; each block is freed once)")
        for b in blocks:
            self._is_free[b] = 1
        self._free.extend(reversed(blocks))

    def slot(self, blocks: list[int], position: int) -> int:
        """Flat cache row of token ``position`` of a sequence that owns ``blocks``."""
        return blocks[position // self.block_size] * self.block_size + position % self.block_size


class SlotAllocator:
    """Rows of the SSM state buffers, kept compact: running sequences occupy rows 0..n-1, so a decode step
    hands the model a prefix view of each buffer. Freeing a row moves the last sequence into it; the caller
    copies that row's states (``free`` returns the move)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.owners: list[object] = []

    @property
    def num_used(self) -> int:
        return len(self.owners)

    def can_allocate(self) -> bool:
        return len(self.owners) < self.num_slots

    def allocate(self, owner) -> int:
        if not self.can_allocate():
            raise OutOfBlocks("no free SSM state slot")
        self.owners.append(owner)
        return len(self.owners) - 1

    def free(self, slot: int) -> tuple[int, int, object] | None:
        """Release ``slot``; returns (from_row, to_row, moved_owner) when the last row moved into it."""
        last = len(self.owners) - 1
        if not 0 <= slot <= last:
            raise ValueError(f"slot {slot} is not in use")
        if slot == last:
            self.owners.pop()
            return None
        moved = self.owners.pop()
        self.owners[slot] = moved
        return last, slot, moved
