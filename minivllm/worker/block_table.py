"""The runner's copy of every running request's block table, one row per request.

The scheduler's ``KVCacheManager`` decides which blocks a request holds; the runner only needs
their ids, laid out as a matrix the attention kernels index (``block_tables[row, i]``: the
i-th block of the request in that row). Rows persist across steps: a step appends the few
blocks the scheduler added (one every ``block_size`` tokens of a decode) instead of rebuilding
every row from scratch (chapter 10).

``compute_slot_mapping`` turns (row, position) pairs into KV-cache slots for the whole batch
at once, the vectorised form of chapter 03's formula

    slot = block_table[row][position // block_size] * block_size + position % block_size
"""

from __future__ import annotations

import numpy as np
import torch


def compute_slot_mapping(block_table, positions, block_size: int) -> np.ndarray:
    """One request's slots: the formula above for a single block table (chapter 03)."""
    positions = np.asarray(positions, dtype=np.int64)
    block_ids = np.asarray(block_table, dtype=np.int64)
    return block_ids[positions // block_size] * block_size + positions % block_size


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int,
                 device: torch.device, pin_memory: bool) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin_memory)
        self.block_table_np = self.block_table_cpu.numpy()
        # what the kernels read; on a CPU the very same tensor (nothing to copy)
        self.block_table = (self.block_table_cpu if device.type == "cpu"
                            else torch.zeros(shape, dtype=torch.int32, device=device))
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row]
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row} would hold {end} blocks; at most "
                             f"{self.max_num_blocks_per_req} fit max_model_len")
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks_per_row[src]
        self.block_table_np[dst, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[dst] = n

    def swap_rows(self, a: int, b: int) -> None:
        n = max(self.num_blocks_per_row[a], self.num_blocks_per_row[b])
        self.block_table_np[[a, b], :n] = self.block_table_np[[b, a], :n]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray,
                             out: np.ndarray) -> None:
        """Slots of every scheduled token at once: token t is at ``positions[t]`` of the request
        in row ``req_indices[t]``. Writes into ``out`` (int64, one per token)."""
        block_numbers = self.block_table_np[req_indices, positions // self.block_size]
        np.add(block_numbers.astype(np.int64) * self.block_size, positions % self.block_size,
               out=out)

    def commit(self, num_reqs: int) -> None:
        """Copy the used rows to the device (non-blocking; a no-op on a CPU)."""
        if self.block_table is not self.block_table_cpu:
            self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs], non_blocking=True)
