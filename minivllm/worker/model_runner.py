"""The model runner: turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

Per step it builds, from the scheduled requests (decodes first, then prefill chunks):

* ``input_ids`` / ``positions`` — every scheduled token, flattened, with its position;
* ``slot_mapping`` — where each token's K/V goes: ``block_id * block_size + offset``;
* ``block_tables`` / ``seq_lens`` / ``query_start_loc`` — what each sequence attends to;
* ``logits_indices`` — the last token of each request that samples this step: only those rows
  go through the lm_head.

It also owns the KV cache tensors (one per layer) and binds them to the attention layers,
picks the elementwise ops (fused Triton kernels, ``torch.compile``, or plain torch: one switch,
``EngineConfig.use_custom_ops`` / ``compile``), and on CUDA replays decode steps from CUDA
graphs (``minivllm/worker/cuda_graphs.py``; off with ``enforce_eager=True``).
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.attention.backend import AttentionMetadata, get_attention_backend
from minivllm.config import EngineConfig
from minivllm.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from minivllm.model.layers import NATIVE_OPS, use_elementwise_ops
from minivllm.model.loader import load_model
from minivllm.sample.sampler import Sampler, SamplingMetadata
from minivllm.worker.cuda_graphs import DecodeCudaGraphs

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on a CPU: 1 GiB


def compute_slot_mapping(block_table, positions, block_size: int) -> np.ndarray:
    """The slot of each position's K/V: block_table[p // block_size] * block_size + p % block_size.

    vLLM computes the same in ``BlockTable.compute_slot_mapping`` (chapter 03, exercise 3.1).
    """
    positions = np.asarray(positions, dtype=np.int64)
    block_ids = np.asarray(block_table, dtype=np.int64)
    return block_ids[positions // block_size] * block_size + positions % block_size


class ModelRunner:
    # swappable, so a learner's slot mapping can run inside the real engine (chapter 03)
    compute_slot_mapping = staticmethod(compute_slot_mapping)

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = load_model(
            config.model_path, config.model_config, config.device, config.dtype, show_progress
        )
        self.attention_backend = get_attention_backend(config.attention_backend)
        for layer in self.model.attention_layers():
            layer.backend = self.attention_backend
        if config.use_custom_ops:
            from minivllm.kernels import triton_elementwise_ops

            use_elementwise_ops(self.model, triton_elementwise_ops())
        elif config.compile:
            # dynamic: one compiled graph serves every batch size
            use_elementwise_ops(self.model, {name: torch.compile(fn, dynamic=True)
                                             for name, fn in NATIVE_OPS.items()})
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.sampler = (config.sampler_cls or Sampler)()
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.request_generators: dict[str, torch.Generator] = {}

    # -- KV cache --------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        return self.block_size * self.config.model_config.kv_bytes_per_token(self.config.dtype)

    def determine_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_cache_bytes_per_block()
        if self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_free_memory()
        else:
            budget = CPU_KV_CACHE_BYTES
        # never more blocks than max_num_seqs full-length sequences could use
        cap = self.config.max_num_seqs * -(-self.config.max_model_len // self.block_size)
        return max(1, min(budget // per_block, cap))

    def _profile_cuda_free_memory(self) -> int:
        """GPU bytes left for the KV cache after the weights and one worst-case forward."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * self.config.gpu_memory_utilization - peak - used_by_others)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over ``max_num_batched_tokens`` tokens with a throwaway KV cache."""
        c = self.config.model_config
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        # enough blocks for the block table to cover the whole sequence (kernels read through it)
        num_blocks = -(-n // self.block_size)
        dummy = torch.zeros(2, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim,
                            dtype=self.config.dtype, device=self.device)
        for layer in self.model.attention_layers():
            layer.kv_cache = dummy
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        meta = AttentionMetadata(
            num_actual_tokens=n, num_decodes=0, num_decode_tokens=0, max_query_len=n,
            max_seq_len=n,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
            query_start_loc_cpu=[0, n], seq_lens_cpu=[n],
        )
        hidden = self.model(ids, pos, meta)
        self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        for layer in self.model.attention_layers():
            layer.kv_cache = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        c = self.config.model_config
        shape = (2, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        # zeros, not empty: padded reads past a sequence's end must see finite values
        self.kv_caches = [
            torch.zeros(shape, dtype=self.config.dtype, device=self.device)
            for _ in range(c.num_hidden_layers)
        ]
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches):
            layer.kv_cache = cache
        if self.config.use_cuda_graph and self.attention_backend.supports_cuda_graph:
            self.capture_model()

    def capture_model(self, capture: bool = True) -> None:
        """Record decode steps as CUDA graphs (the graphs bind the KV cache tensors above).

        ``capture=False`` keeps the padded static-buffer path but runs it eagerly (CPU tests).
        """
        c = self.config
        self.cuda_graphs = DecodeCudaGraphs(self.model, c.max_num_seqs, c.max_model_len,
                                            self.block_size, self.device, capture=capture)
        self.cuda_graphs.capture()

    # -- one step --------------------------------------------------------------------------
    def prepare_inputs(self, scheduled: list[ScheduledRequest]):
        """Flatten the scheduled requests (decodes first) into model inputs and metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for s in scheduled:
            start, n = s.num_computed_tokens, s.num_tokens
            input_ids.extend(s.token_ids)
            pos = np.arange(start, start + n)
            positions.append(pos)
            slots.append(np.asarray(self.compute_slot_mapping(s.block_ids, pos, bs), dtype=np.int64))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            if s.sample:
                logits_indices.append(query_start_loc[-1] - 1)
        num_decodes = sum(1 for s in scheduled if s.num_tokens == 1)
        max_blocks = max(len(s.block_ids) for s in scheduled)
        table = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            table[i, : len(s.block_ids)] = s.block_ids

        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=max(s.num_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.from_numpy(np.concatenate(positions)).to(dev)
        return ids, pos, meta, torch.tensor(logits_indices, dtype=torch.long, device=dev)

    def _sampling_metadata(self, to_sample: list[ScheduledRequest]) -> SamplingMetadata:
        params = [s.sampling_params for s in to_sample]
        dev = self.device
        all_greedy = all(p.greedy for p in params)
        meta = SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            all_greedy=all_greedy,
            generator=self.generator,
        )
        if all_greedy:
            return meta
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        for row, s in enumerate(to_sample):
            seed = s.sampling_params.seed
            if seed is None or s.sampling_params.greedy:
                continue
            gen = self.request_generators.get(s.request_id)
            if gen is None:
                gen = torch.Generator(device=dev).manual_seed(seed)
                self.request_generators[s.request_id] = gen
            meta.generators[row] = gen
        return meta

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for rid in scheduler_output.finished_req_ids:
            self.request_generators.pop(rid, None)
        # single-token queries (decodes) first: the attention backend batches them together
        scheduled = sorted(scheduler_output.scheduled, key=lambda s: s.num_tokens != 1)
        if not scheduled:
            return ModelRunnerOutput(sampled_token_ids={})
        input_ids, positions, meta, logits_indices = self.prepare_inputs(scheduled)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        sampled: dict[str, list[int]] = {s.request_id: [] for s in scheduled}
        to_sample = [s for s in scheduled if s.sample]
        if to_sample:
            logits = self.model.compute_logits(hidden[logits_indices])
            tokens = self.sampler(logits, self._sampling_metadata(to_sample)).tolist()
            for s, t in zip(to_sample, tokens):
                sampled[s.request_id] = [t]
        return ModelRunnerOutput(sampled_token_ids=sampled)
