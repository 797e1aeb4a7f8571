"""`BlockManager`: hands out the paged KV cache's blocks to sequences' block tables.

The cache (models/kv_cache.py) holds `num_blocks` blocks of `block_size` token
positions; position p of a sequence lives in block `block_table[p // block_size]`.
The workers keep no allocation state: a block is in use only while some block
table names it, so freeing is local bookkeeping and needs no message.
"""

from __future__ import annotations

__all__ = ["BlockManager"]


class BlockManager:
    """Free-list allocator of KV blocks; a sequence's block table is a plain list it grows and frees.

    Every operation is O(blocks moved), so a decode step that crosses no block
    boundary costs one comparison.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack popped from the end; reversed so that block 0 goes first (easier to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_positions: int) -> int:
        """Blocks that cover positions [0, num_positions)."""
        return -(-num_positions // self.block_size)

    def blocks_needed(self, block_table: list[int], num_positions: int) -> int:
        """Blocks `block_table` lacks to cover positions [0, num_positions)."""
        return max(0, -(-num_positions // self.block_size) - len(block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, block_table: list[int], num_positions: int) -> bool:
        """Grows `block_table` in place to cover [0, num_positions); False (and no change) if the blocks are not free."""
        need = -(-num_positions // self.block_size) - len(block_table)
        if need <= 0:
            return True
        free = self._free
        if need > len(free):
            return False
        take = free[-need:]
        del free[-need:]
        take.reverse()
        block_table.extend(take)
        return True

    def free(self, block_table: list[int]) -> None:
        """Returns every block of `block_table` and empties it."""
        if not block_table:
            return
        self._free.extend(reversed(block_table))
        block_table.clear()
        assert len(self._free) <= self.num_blocks, "a KV block was freed twice"
