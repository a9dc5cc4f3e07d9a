"""The model runner: applies a ``SchedulerOutput`` to its persistent batch, runs one forward
pass, samples.

Per step (vLLM v1's ``GPUModelRunner``, chapter 10):

1. ``_update_states`` applies the scheduler's diff to the ``InputBatch``: finished and
   preempted requests leave their rows, new ones take a row, running ones append the blocks
   they gained; rows are condensed and the decodes moved to the front.
2. ``prepare_inputs`` builds, with a few numpy operations over the whole batch (no Python loop
   over tokens): ``input_ids`` and ``positions`` of every scheduled token, ``slot_mapping``
   (where each token's K/V goes), ``query_start_loc`` / ``seq_lens`` (what each sequence
   attends to), and the row of each request's last token (``logits_indices``). They are
   written into buffers allocated once; on CUDA those are pinned host buffers copied to
   device buffers with ``non_blocking`` copies, and the CUDA graphs read the same device
   buffers.
3. The forward pass, then the lm_head and the sampler for the requests that reach the end of
   their known tokens this step (a prefill chunk in the middle of a prompt samples nothing).
   The sampled tokens are appended to the batch's own token ids: they never travel back.

It also owns the KV cache tensors (one per layer), picks the elementwise ops (fused Triton
kernels, ``torch.compile``, C kernels on a CPU in float32 (``cpu_kernels``), or plain torch:
``EngineConfig.compilation_config``), and on CUDA replays decode steps from CUDA graphs
(``cuda_graphs.py``), on a CPU runs a step's decoder layers in one C++ call
(``cpu_layers.py``; both off with ``enforce_eager``).
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.attention.backend import AttentionMetadata, get_attention_backend
from minivllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.cpu_kernels import cpu_elementwise_ops
from minivllm.model.cpu_gemm import pack_linear_weights, should_pack
from minivllm.model.layers import NATIVE_OPS, use_elementwise_ops
from minivllm.model.loader import load_model
from minivllm.sample.sampler import Sampler, SamplingMetadata
from minivllm.worker.cpu_layers import CpuDecoderLayers
from minivllm.worker.cuda_graphs import DecodeCudaGraphs, cudagraph_batch_sizes
from minivllm.worker.input_batch import CachedRequestState, InputBatch
from minivllm.utils import cdiv

_GREEDY_EPS = 1e-5


class CpuGpuBuffer:
    """A host buffer (numpy view ``np`` of a torch tensor ``cpu``, pinned on CUDA) and the
    device buffer the model reads (``gpu``; on a CPU the very same tensor)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=device) if on_cuda else self.cpu

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class CopyFence:
    """Keeps the host from rewriting pinned buffers that a ``non_blocking`` copy may still be
    reading. A step records an event after its host-to-device copies; the next step waits on it
    before it writes those buffers again. Most steps sync anyway (the sampled tokens come back to
    the host), but a step that samples nothing (a chunk in the middle of a long prompt) does not:
    without the fence, the next step's inputs could overwrite this step's slot mapping before
    the GPU read it, and K/V would land in the wrong slots. No-op on a CPU (nothing is copied).
    """

    def __init__(self, device: torch.device, event_factory=None) -> None:
        if event_factory is None and device.type == "cuda":
            event_factory = torch.cuda.Event
        self._factory = event_factory
        self._event = None

    def record(self) -> None:
        if self._factory is not None:
            self._event = self._factory()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


class ModelRunner:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        model_config, sched = config.model_config, config.scheduler_config
        self.device = config.device_config.device
        self.block_size = config.cache_config.block_size
        torch.manual_seed(model_config.seed)
        self.model = load_model(model_config.model_path, model_config.hf_config, self.device,
                                model_config.dtype, show_progress)
        if should_pack(self.device, model_config.dtype):
            pack_linear_weights(self.model)  # oneDNN's layout, once (``model/cpu_gemm.py``)
        # this rank's KV heads (all of them without tensor parallelism)
        self.num_kv_heads = self.model.attention_layers()[0].num_kv_heads
        self.attention_backend = get_attention_backend(config.compilation_config.attention_backend)
        for layer in self.model.attention_layers():
            layer.backend = self.attention_backend
        self.cpu_ops: dict | None = None  # the C elementwise ops, where the runner picked them
        if config.compilation_config.use_custom_ops:
            from minivllm.kernels import triton_elementwise_ops

            use_elementwise_ops(self.model, triton_elementwise_ops())
        elif config.compilation_config.compile:
            # dynamic: one compiled graph serves every batch size
            use_elementwise_ops(self.model, {name: torch.compile(fn, dynamic=True)
                                             for name, fn in NATIVE_OPS.items()})
        elif self.device.type == "cpu" and model_config.dtype == torch.float32:
            # one C call per RMSNorm, rotary and SiLU-and-mul (``cpu_kernels``), when it builds
            self.cpu_ops = cpu_elementwise_ops(NATIVE_OPS)
            use_elementwise_ops(self.model, self.cpu_ops or NATIVE_OPS)
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.cpu_layers: CpuDecoderLayers | None = None  # a CPU step's layers in one call
        self.sampler = (config.sampler_cls or Sampler)()
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(device=self.device).manual_seed(model_config.seed)

        # step buffers, allocated once; a CUDA-graph batch is padded up to a captured size,
        # which may exceed max_num_seqs and the token budget
        max_graph_batch = cudagraph_batch_sizes(sched.max_num_seqs)[-1]
        max_reqs = max(sched.max_num_seqs, max_graph_batch)
        max_tokens = max(sched.max_num_batched_tokens, max_graph_batch)
        # the persistent batch, and every request the runner holds (also those without a row)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(max_reqs, model_config.max_model_len, self.block_size,
                                      self.device, pin_memory=self.device.type == "cuda")
        self.input_ids = CpuGpuBuffer(max_tokens, torch.int32, self.device)
        self.positions = CpuGpuBuffer(max_tokens, torch.int64, self.device)
        self.slot_mapping = CpuGpuBuffer(max_tokens, torch.int64, self.device)
        self.query_start_loc = CpuGpuBuffer(max_reqs + 1, torch.int32, self.device)
        self.seq_lens = CpuGpuBuffer(max_reqs, torch.int32, self.device)
        # rows of the hidden states to sample from (pinned too: a pageable copy would sync)
        self.logits_indices = CpuGpuBuffer(max_reqs, torch.int64, self.device)
        self.copy_fence = CopyFence(self.device)
        self.arange = np.arange(max(max_tokens, max_reqs + 1), dtype=np.int64)
        self._batch_sampling_metadata: SamplingMetadata | None = None

    # -- KV cache --------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        c = self.config.model_config.hf_config
        elem = torch.tensor([], dtype=self.config.model_config.dtype).element_size()
        return self.block_size * 2 * c.num_hidden_layers * self.num_kv_heads * c.head_dim * elem

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.kv_cache_bytes_per_block()
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_free_memory()
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        # never more blocks than max_num_seqs full-length sequences could use
        cap = (self.config.scheduler_config.max_num_seqs
               * cdiv(self.config.model_config.max_model_len, self.block_size))
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
        return int(total * self.config.cache_config.gpu_memory_utilization - peak - used_by_others)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over ``max_num_batched_tokens`` tokens with a throwaway KV cache."""
        c = self.config.model_config.hf_config
        n = min(self.config.scheduler_config.max_num_batched_tokens,
                self.config.model_config.max_model_len)
        num_blocks = cdiv(n, self.block_size)
        dummy = torch.zeros(2, num_blocks, self.block_size, self.num_kv_heads, c.head_dim,
                            dtype=self.config.model_config.dtype, device=self.device)
        for layer in self.model.attention_layers():
            layer.kv_cache = dummy
        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=n, num_decodes=0, max_query_len=n, max_seq_len=n,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
            query_start_loc_cpu=np.array([0, n]), seq_lens_cpu=np.array([n]),
        )
        meta = self.attention_backend.build_metadata(meta, self.block_size)
        hidden = self.model(torch.zeros(n, dtype=torch.int32, device=dev),
                            torch.arange(n, device=dev), meta)
        self.model.compute_logits(hidden[-min(n, self.config.scheduler_config.max_num_seqs):])
        for layer in self.model.attention_layers():
            layer.kv_cache = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        c = self.config.model_config.hf_config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        # zeros, not empty: padded reads past a sequence's end must see finite values
        self.kv_caches = [
            torch.zeros(shape, dtype=self.config.model_config.dtype, device=self.device)
            for _ in range(c.num_hidden_layers)
        ]
        for layer, cache in zip(self.model.attention_layers(), self.kv_caches):
            layer.kv_cache = cache
        if (self.config.compilation_config.use_cuda_graph
                and self.attention_backend.supports_cuda_graph):
            self.capture_model()
        if self.config.compilation_config.use_cpu_layer_loop:
            self.cpu_layers = CpuDecoderLayers.create(self.model, self.cpu_ops, self.kv_caches)

    def capture_model(self, capture: bool = True) -> None:
        """Record decode steps as CUDA graphs over the runner's own step buffers.

        ``capture=False`` keeps the padded static-buffer path but runs it eagerly (CPU tests).
        """
        c = self.config
        self.cuda_graphs = DecodeCudaGraphs(
            self.model, c.scheduler_config.max_num_seqs, c.model_config.max_model_len,
            input_ids=self.input_ids.gpu,
            positions=self.positions.gpu, slot_mapping=self.slot_mapping.gpu,
            seq_lens=self.seq_lens.gpu, query_start_loc=self.query_start_loc.gpu,
            block_tables=self.input_batch.block_table.block_table, capture=capture)
        self.cuda_graphs.capture()

    # -- one step --------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the persistent batch."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove_request(rid)
        for rid in so.preempted_req_ids:
            self._release_row(rid)
        scheduled = so.num_scheduled_tokens
        for rid in [r for r in batch.req_id_to_index if r not in scheduled]:
            self._release_row(rid)  # running, but given no tokens this step

        for new in so.scheduled_new_reqs:
            if new.req_id in self.requests:  # an id reused before its end reached the runner
                self.requests.pop(new.req_id)
                batch.remove_request(new.req_id)
            params = new.sampling_params
            generator = None
            if params.seed is not None and params.temperature >= _GREEDY_EPS:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            state = CachedRequestState(new.req_id, new.prompt_token_ids, params, generator,
                                       list(new.block_ids), new.num_computed_tokens)
            self.requests[new.req_id] = state
            batch.add_request(state)

        cached = so.scheduled_cached_reqs
        rows, computed = [], []
        for rid, resumed, new_blocks, num_computed in zip(
                cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids,
                cached.num_computed_tokens):
            state = self.requests[rid]
            if resumed:  # a fresh block table; whatever row it still had is stale
                self._release_row(rid)
                state.block_ids = list(new_blocks)
            elif new_blocks:
                state.block_ids.extend(new_blocks)
            row = batch.req_id_to_index.get(rid)
            if row is None:  # back after preemption, or after a step without tokens
                state.num_computed_tokens = num_computed
                batch.add_request(state)
            else:
                if new_blocks:
                    batch.block_table.append_row(new_blocks, row)
                rows.append(row)
                computed.append(num_computed)
        batch.num_computed_tokens[rows] = computed
        batch.condense()

    def _release_row(self, req_id: str) -> None:
        """Take a request out of the batch but remember its tokens (it will be back)."""
        if req_id in self.input_batch.req_id_to_index:
            self.requests[req_id].token_ids = self.input_batch.token_ids_of(req_id)
            self.input_batch.remove_request(req_id)

    def prepare_inputs(self, so: SchedulerOutput):
        """Model inputs and attention metadata for the whole batch, vectorised over tokens."""
        batch = self.input_batch
        n = batch.num_reqs
        scheduled = so.num_scheduled_tokens
        num_sched = np.array([scheduled[rid] for rid in batch.req_ids[:n]], dtype=np.int64)
        num_decodes = batch.reorder_decodes_first(num_sched)

        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        self._ensure_token_capacity(total)
        # token t belongs to row req_indices[t], at offset offsets[t] of that row's new tokens
        req_indices = np.repeat(self.arange[:n], num_sched)
        offsets = self.arange[:total] - np.repeat(cu - num_sched, num_sched)
        positions = self.positions.np[:total]
        np.add(batch.num_computed_tokens[req_indices], offsets, out=positions)
        np.take(batch.token_ids.ravel(), positions + req_indices * batch.token_ids.shape[1],
                out=self.input_ids.np[:total])
        batch.block_table.compute_slot_mapping(req_indices, positions, self.slot_mapping.np[:total])
        qsl = self.query_start_loc.np
        qsl[0] = 0
        qsl[1 : n + 1] = cu
        seq_lens = self.seq_lens.np[:n]
        np.add(batch.num_computed_tokens[:n], num_sched, out=seq_lens)
        batch.block_table.commit(n)

        meta = AttentionMetadata(
            num_actual_tokens=total,
            num_decodes=num_decodes,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=self.query_start_loc.copy_to_gpu(n + 1),
            seq_lens=self.seq_lens.copy_to_gpu(n),
            block_tables=batch.block_table.block_table[:n],
            slot_mapping=self.slot_mapping.copy_to_gpu(total),
            query_start_loc_cpu=qsl[: n + 1],
            seq_lens_cpu=seq_lens,
        )
        # rows whose step reaches the end of their known tokens sample one; the others are
        # prefill chunks in the middle of a prompt
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:n])
        return (self.input_ids.copy_to_gpu(total), self.positions.copy_to_gpu(total), meta,
                sample_rows, cu)

    def _ensure_token_capacity(self, num_tokens: int) -> None:
        """Grow the step buffers for a step larger than the budget they were sized for (a
        scheduler swapped in with a bigger ``max_num_batched_tokens``, as the course does)."""
        if num_tokens <= len(self.input_ids.np):
            return
        if self.cuda_graphs is not None:  # the graphs hold the buffers' addresses
            raise ValueError(f"a step of {num_tokens} tokens exceeds the {len(self.input_ids.np)} "
                             "the CUDA graphs were captured with (max_num_batched_tokens)")
        self.input_ids = CpuGpuBuffer(num_tokens, torch.int32, self.device)
        self.positions = CpuGpuBuffer(num_tokens, torch.int64, self.device)
        self.slot_mapping = CpuGpuBuffer(num_tokens, torch.int64, self.device)
        self.arange = np.arange(max(num_tokens, len(self.arange)), dtype=np.int64)

    def _sampling_metadata(self, sample_rows: np.ndarray) -> SamplingMetadata:
        """The batch's sampling tensors (rebuilt only when its rows changed), for ``sample_rows``."""
        batch = self.input_batch
        n = batch.num_reqs
        if batch.batch_changed or self._batch_sampling_metadata is None:
            self._batch_sampling_metadata = self._build_sampling_metadata(np.arange(n))
            batch.batch_changed = False
        if len(sample_rows) == n:
            return self._batch_sampling_metadata
        return self._build_sampling_metadata(sample_rows)  # a prefill chunk samples nothing

    def _build_sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        batch = self.input_batch
        dev = self.device
        temperature = batch.temperature[rows]
        all_greedy = bool((temperature < _GREEDY_EPS).all())
        meta = SamplingMetadata(
            temperature=torch.from_numpy(temperature).to(dev), all_greedy=all_greedy,
            generator=self.generator)
        if all_greedy:
            return meta
        top_k, top_p = batch.top_k[rows], batch.top_p[rows]
        if (top_k > 0).any():
            meta.top_k = torch.from_numpy(top_k).to(dev)
            meta.max_top_k = int(top_k[top_k > 0].max())  # from the host copy: no device sync
        if (top_p < 1.0).any():
            meta.top_p = torch.from_numpy(top_p).to(dev)
        if batch.generators:
            position = {row: i for i, row in enumerate(rows.tolist())}
            meta.generators = {position[row]: gen for row, gen in batch.generators.items()
                               if row in position}
        return meta

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # the last step's copies out of the pinned buffers (the block table's too) must be done
        # before _update_states and prepare_inputs write them again
        self.copy_fence.wait()
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        input_ids, positions, meta, sample_rows, cu = self.prepare_inputs(scheduler_output)
        if not len(sample_rows):
            self.copy_fence.record()  # nothing sampled: no sync ends this step
        hidden, sampled_rows_only = None, False
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(input_ids, positions, meta)
        elif self.cpu_layers is not None:  # a row per sampled request
            hidden = self.cpu_layers.run(input_ids, positions, meta, torch.from_numpy(
                sample_rows.astype(np.int64, copy=False)))
            sampled_rows_only = hidden is not None
        if hidden is None:
            attn_meta = self.attention_backend.build_metadata(meta, self.block_size)
            hidden = self.model(input_ids, positions, attn_meta)

        batch = self.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        sampled: list[list[int]] = [[] for _ in range(n)]
        if len(sample_rows):
            k = len(sample_rows)
            np.subtract(cu[sample_rows], 1, out=self.logits_indices.np[:k])
            logits_indices = self.logits_indices.copy_to_gpu(k)
            self.copy_fence.record()
            logits = self.model.compute_logits(
                hidden if sampled_rows_only else hidden[logits_indices])
            tokens = self.sampler(logits, self._sampling_metadata(sample_rows)).cpu().numpy()
            batch.append_sampled(sample_rows, tokens)
            for row, token in zip(sample_rows.tolist(), tokens.tolist()):
                sampled[row] = [token]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
