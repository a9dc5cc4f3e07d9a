"""A CPU step's decoder layers in one C++ call: the CPU's counterpart of the CUDA graphs.

On a GPU, a small model's decode step is hundreds of kernel launches that the CPU issues one by
one, and CUDA graphs replay them in one call (``cuda_graphs.py``). A CPU has the same problem
in another form: between two kernels the interpreter runs the modules' ``forward`` methods,
picks the ops and goes through torch's dispatcher, while torch's other threads wait for the
next parallel loop. On a 2-core machine that was about a fifth of a decode step of
SmolLM2-135M at 16 sequences (``perf``: the main thread outside the kernels about 21 % of its
time, the second thread waiting in OpenMP about as long).

``CpuDecoderLayers`` hands the step to ``minivllm_cpu::decoder_layers`` (``cpu_kernels.cpp``),
which runs every decoder layer with the same kernels in the same order as the Python forward
does on a CPU (the C elementwise ops; ``model/cpu_gemm.py``'s panels for a few rows, oneDNN
for more; ``paged_decode`` and ``paged_prefill``), so it returns the same floats. The
embedding, the lm_head and the sampler stay in Python.

Like a CUDA graph, it bypasses whatever Python the forward would have run, so it serves only
while nothing there was changed: the engine's own Llama-family model at tensor-parallel size
1, float32, every linear layer packed, each elementwise module still on the C op the runner
gave it, the torch attention backend in every layer, no forward hooks, no ``forward`` replaced
on the model (the course records forwards that way), no per-head q/k norm (Qwen3), and a head
size the prefill kernel takes (a multiple of 16) when the step has prefill chunks. It reads
all of that from the model every step (about 0.5 ms for the bundled model), so a change is
seen at the next step; anything else runs the Python forward. ``enforce_eager`` turns it off,
as it turns the CUDA graphs off.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm import cpu_kernels
from minivllm.attention.backend import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.model.cpu_gemm import few_rows_max
from minivllm.model.llama import LlamaForCausalLM


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks
                or "forward" in module.__dict__)


class CpuDecoderLayers:
    """Runs a step's decoder layers through ``decoder_layers``; ``ops`` are the elementwise
    ops the runner gave the model (``cpu_elementwise_ops``)."""

    def __init__(self, model: LlamaForCausalLM, ops: dict, kv_caches: list[torch.Tensor],
                 library) -> None:
        self.model, self.ops, self.kv_caches = model, ops, kv_caches
        self.run_layers = library.decoder_layers.default

    @classmethod
    def create(cls, model: nn.Module, ops: dict | None, kv_caches: list[torch.Tensor]):
        """The loop for ``model``, or None where it can never serve (another model class, a
        per-head q/k norm, the kernels unavailable)."""
        library = cpu_kernels.library()
        if (library is None or ops is None or type(model) is not LlamaForCausalLM
                or model.config.qk_norm):
            return None
        return cls(model, ops, kv_caches, library)

    def _arguments(self) -> tuple | None:
        """The layers' weights, biases, windows and constants as ``decoder_layers`` takes them,
        read from the model, or None where the loop must not serve."""
        model = self.model
        hooks = torch.nn.modules.module
        if (_hooked(model) or _hooked(model.model) or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks):
            return None
        layers = model.model.layers
        weights, biases, windows = [], [], []
        eps, scale, rotary, ops = None, None, None, self.ops
        for layer, cache in zip(layers, self.kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (any(map(_hooked, (layer, attn, mlp, *norms, *linears, attn.rotary_emb,
                                  mlp.act_fn)))
                    or any(n.op is not ops["rms_norm"] for n in norms)
                    or attn.rotary_emb.op is not ops["rotary_embedding"]
                    or mlp.act_fn.op is not ops["silu_and_mul"]
                    or type(attn.backend) is not TorchAttentionBackend
                    or "forward" in vars(attn.backend)
                    or attn.kv_cache is not cache
                    or any(getattr(lin, "panel_weight", None) is None
                           or lin.packed_weight is None for lin in linears)):
                return None
            if eps not in (None, norms[0].eps) or norms[0].eps != norms[1].eps:
                return None
            eps, scale, rotary = norms[0].eps, attn.scale, attn.rotary_emb
            weights.append(norms[0].weight)
            for i, lin in enumerate(linears):
                if i == 2:
                    weights.append(norms[1].weight)
                weights += [lin.panel_weight, lin.packed_weight]
            biases.append(attn.qkv_proj.bias)
            windows.append(attn.sliding_window or 0)
        final = model.model.norm
        if (_hooked(final) or final.op is not ops["rms_norm"] or final.eps != eps
                or len(self.kv_caches) != len(layers)):
            return None
        weights.append(final.weight)
        heads = [attn.num_heads, attn.num_kv_heads, attn.head_dim]
        return weights, biases, windows, heads, eps, scale, rotary

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            keep: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final norm's output for the step, or None (nothing run) where the loop does not
        serve it: the caller then runs the Python forward.

        ``keep`` (int64 sequence indices, rising, every decode among them): only those
        sequences' last rows are wanted (the rows the sampler reads), so the last layer goes
        past its K/V for them alone and the output has a row per kept sequence. The step's
        other rows would be computed to be thrown away: the last layer's attention output,
        o_proj and MLP for them is about 3 % of a long prefill chunk's work."""
        n = meta.num_actual_tokens
        if not n or torch.is_grad_enabled():
            return None
        arguments = self._arguments()
        if arguments is None:
            return None
        weights, biases, windows, heads, eps, scale, rotary = arguments
        if meta.num_prefills and not cpu_kernels.prefill_takes(heads[2]):
            return None
        hidden = self.model.model.embed_tokens(input_ids[:n])
        if not (cpu_kernels.few_rows_fit(hidden) and hidden.is_contiguous()):
            return None
        rows = cpu_kernels.int32_rows
        return self.run_layers(
            hidden, positions[:n].to(torch.int64).contiguous(),
            meta.slot_mapping[:n].to(torch.int64).contiguous(), rows(meta.block_tables),
            rows(meta.seq_lens), rows(meta.query_start_loc), meta.num_decodes, weights, biases,
            self.kv_caches, rotary.cos_sin_cache(hidden.device), windows, heads, eps, scale,
            few_rows_max(), keep)
