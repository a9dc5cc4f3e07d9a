"""The persistent input batch: every running request's state, one row each, kept between steps.

Rebuilding the batch from scratch every step (the old way) costs host time proportional to
everything the batch holds: each request's whole token list and block list, each sampling
parameter turned into a fresh tensor. vLLM v1 keeps the batch instead (``InputBatch`` in
``vllm/v1/worker/gpu_input_batch.py``) and applies the scheduler's diff to it:

* a new request fills an empty row (its prompt, sampling parameters and block table, once);
* a running request appends the blocks it gained and the token it sampled;
* a finished or preempted request empties its row, and ``condense`` moves the last rows into
  the holes so rows ``0 .. num_reqs-1`` stay dense.

Everything is a numpy array indexed by row, so the model inputs for the whole batch come out
of a few vectorised operations (``ModelRunner.prepare_inputs``), and the sampling tensors are
views of the same arrays, rebuilt only when a row changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.block_table import BlockTable
from minivllm.utils import cdiv


@dataclass
class CachedRequestState:
    """What the runner remembers of a request, also while it has no row (preempted, or not
    scheduled this step)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # the request's own RNG when it has a seed
    block_ids: list[int]
    num_computed_tokens: int
    # prompt + outputs, saved when the request loses its row (None: only the prompt so far)
    token_ids: np.ndarray | None = None


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 device: torch.device, pin_memory: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = []  # row -> request id; None marks an empty row
        self.req_id_to_index: dict[str, int] = {}

        # a row holds up to max_model_len tokens of context, plus the one token sampled after
        # a context that fills it (a prompt of exactly max_model_len tokens still gets one)
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # prompt + outputs so far
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, cdiv(max_model_len, block_size), block_size,
                                      device, pin_memory)
        # sampling parameters, one entry per row
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.generators: dict[int, torch.Generator] = {}  # row -> the request's seeded RNG
        # set whenever a row is added, removed or moved: the sampling tensors are stale
        self.batch_changed = True

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    # -- rows in and out ----------------------------------------------------------------------
    def add_request(self, state: CachedRequestState) -> int:
        """Put a request in the first empty row (or a new one at the end); returns the row."""
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} already has a row")
        try:
            row = self.req_ids.index(None)
        except ValueError:
            row = len(self.req_ids)
            if row >= self.max_num_reqs:
                raise ValueError(f"the batch holds at most {self.max_num_reqs} requests") from None
            self.req_ids.append(None)
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row

        tokens = state.token_ids if state.token_ids is not None else state.prompt_token_ids
        n = len(tokens)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)

        params = state.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        if state.generator is not None:
            self.generators[row] = state.generator
        self.batch_changed = True
        return row

    def token_ids_of(self, req_id: str) -> np.ndarray:
        """A copy of the request's tokens (prompt + outputs), e.g. to keep while it has no row."""
        row = self.req_id_to_index[req_id]
        return self.token_ids[row, : self.num_tokens[row]].copy()

    def remove_request(self, req_id: str) -> int | None:
        """Empty the request's row (a hole until ``condense``); None if it had no row."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.generators.pop(row, None)
        self.batch_changed = True
        return row

    def condense(self) -> None:
        """Move the last rows into the holes, so that rows 0 .. num_reqs-1 are all in use."""
        holes = [row for row, rid in enumerate(self.req_ids) if rid is None]
        for hole in holes:
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
            last = len(self.req_ids) - 1
            if hole >= last:
                break
            self._move_row(last, hole)
            self.req_ids.pop()
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()

    def _move_row(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                    self.temperature, self.top_p, self.top_k):
            arr[dst] = arr[src]
        self.block_table.move_row(src, dst)
        gen = self.generators.pop(src, None)
        if gen is not None:
            self.generators[dst] = gen
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.req_id_to_index[rid] = dst
        self.batch_changed = True

    def swap_rows(self, a: int, b: int) -> None:
        n = max(self.num_tokens[a], self.num_tokens[b])
        self.token_ids[[a, b], :n] = self.token_ids[[b, a], :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                    self.temperature, self.top_p, self.top_k):
            arr[[a, b]] = arr[[b, a]]
        self.block_table.swap_rows(a, b)
        ga, gb = self.generators.pop(a, None), self.generators.pop(b, None)
        if ga is not None:
            self.generators[b] = ga
        if gb is not None:
            self.generators[a] = gb
        ra, rb = self.req_ids[a], self.req_ids[b]
        self.req_ids[a], self.req_ids[b] = rb, ra
        self.req_id_to_index[ra], self.req_id_to_index[rb] = b, a
        self.batch_changed = True

    def reorder_decodes_first(self, num_scheduled: np.ndarray) -> int:
        """Swap rows so the ones computing a single token (decodes) come first, as the attention
        kernels expect; permutes ``num_scheduled`` (per row) alongside. Returns how many there
        are. A handful of swaps at most: only prefill rows sitting among the decodes move."""
        is_decode = num_scheduled == 1
        num_decodes = int(is_decode.sum())
        misplaced_prefills = np.flatnonzero(~is_decode[:num_decodes])
        misplaced_decodes = np.flatnonzero(is_decode[num_decodes:]) + num_decodes
        for a, b in zip(misplaced_prefills.tolist(), misplaced_decodes.tolist()):
            self.swap_rows(a, b)
            num_scheduled[[a, b]] = num_scheduled[[b, a]]
        return num_decodes

    # -- after sampling -----------------------------------------------------------------------
    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record each row's newly sampled token (the runner keeps its own copy of the tokens)."""
        ends = self.num_tokens[rows]
        self.token_ids[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1
