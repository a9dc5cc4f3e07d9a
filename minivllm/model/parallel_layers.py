"""Tensor-parallel layers (Megatron-style, with vLLM's names).

A transformer block holds two pairs of matmuls, and each pair splits across ``tp`` ranks with
one collective:

* attention: ``qkv_proj`` is split by heads (``QKVParallelLinear``: a *column* split, each rank
  computes its own query heads and the key/value heads they read), attention runs on those
  heads alone, and ``o_proj`` is split by its *input* (``RowParallelLinear``): each rank's
  product is a partial sum of the full output, and one all-reduce adds them;
* MLP: ``gate_up_proj`` is a column split (``MergedColumnParallelLinear``: each rank a slice
  of the intermediate features, gate and up alike), the SiLU-and-mul is elementwise so it
  stays local, and ``down_proj`` is a row split with one all-reduce.

So a layer costs two all-reduces of ``[tokens, hidden]``, whatever ``tp`` is. The vocabulary
splits too: ``VocabParallelEmbedding`` holds a range of the vocabulary's rows (a token outside
the range looks up zeros; an all-reduce fills in the rest) and ``ParallelLMHead`` computes the
logits of its range, gathered on every rank before sampling.

When there are fewer key/value heads than ranks (GQA with few KV heads), each rank keeps one KV
head, replicated on ``tp / num_kv_heads`` ranks: the query heads of a rank all read that one.
A size that divides neither way is refused (``check_tensor_parallel_size``).

Each layer loads its own slice of a checkpoint tensor (``weight_loader``): the loader hands it
a lazy safetensors slice, so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.cpu_gemm import linear
from minivllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def _shape(w) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice."""
    return tuple(w.get_shape()) if hasattr(w, "get_shape") else tuple(w.shape)


def _copy(dst: torch.Tensor, src) -> None:
    src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"model: a weight slice has shape {tuple(src.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(src)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"tensor_parallel_size: {what} ({numerator}) is not divisible by "
                         f"tensor_parallel_size ({denominator})")
    return numerator // denominator


def kv_head_partition(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(KV heads this rank holds, index of its first one in the checkpoint).

    ``num_kv_heads >= tp_size``: an even split. Fewer: one head per rank, each head replicated
    on ``tp_size // num_kv_heads`` neighbouring ranks.
    """
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) and num_key_value_heads ({num_kv_heads}): "
            "the KV heads can be neither split evenly nor replicated evenly across the ranks "
            "(one must divide the other)")
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return per_rank, tp_rank * per_rank
    return 1, tp_rank // (tp_size // num_kv_heads)


def check_tensor_parallel_size(model_config, tp_size: int) -> None:
    """Refuse a tensor-parallel size the model's shape cannot be split into, before loading."""
    if tp_size == 1:
        return
    divide(model_config.num_attention_heads, tp_size, "num_attention_heads")
    kv_head_partition(model_config.num_key_value_heads, tp_size, 0)
    divide(model_config.intermediate_size, tp_size, "intermediate_size")


class ColumnParallelLinear(nn.Linear):
    """y = x W^T with W's output rows split across ranks: each rank computes a slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        super().__init__(input_size, divide(output_size, self.tp_size, "output size"), bias=bias)
        self.packed_weight = None  # a CPU's prepacked copy of the weight (``cpu_gemm``)
        self.panel_weight = None  # and its panels for few rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        n = param.shape[0]
        _copy(param, loaded[self.tp_rank * n:(self.tp_rank + 1) * n])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (gate and up): each is split alike."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.local_sizes = [divide(s, self.tp_size, "output size") for s in output_sizes]

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        n = self.local_sizes[shard_id]
        dst = param.narrow(0, sum(self.local_sizes[:shard_id]), n)
        _copy(dst, loaded[self.tp_rank * n:(self.tp_rank + 1) * n])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v stacked, split by heads: this rank's query heads and the KV heads they read."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads, self.first_kv_head = kv_head_partition(total_num_kv_heads, tp_size,
                                                                  tp_rank)
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp_size, bias=bias)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: int) -> None:
        d, q, kv = self.head_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == 0:
            offset, size, start = 0, q, self.tp_rank * q
        else:
            offset, size, start = q + (shard_id - 1) * kv, kv, self.first_kv_head * d
        _copy(param.narrow(0, offset, size), loaded[start:start + size])


class RowParallelLinear(nn.Linear):
    """y = x W^T with W's input columns split: each rank holds a slice of x (the output of a
    column-parallel layer) and computes a partial y; one all-reduce sums the partials."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        if bias:
            raise ValueError("RowParallelLinear: a bias is not supported (no model here has one)")
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        super().__init__(divide(input_size, self.tp_size, "input size"), output_size, bias=False)
        self.packed_weight = None  # a CPU's prepacked copy of the weight (``cpu_gemm``)
        self.panel_weight = None  # and its panels for few rows

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        n = param.shape[1]
        _copy(param, loaded[:, self.tp_rank * n:(self.tp_rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(linear(self, x))


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows (padded to a multiple of tp)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        if _shape(loaded)[0] != self.num_embeddings:
            raise ValueError(f"model: an embedding of {_shape(loaded)[0]} rows, expected "
                             f"{self.num_embeddings}")
        n = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        _copy(param[:n], loaded[self.vocab_start:self.vocab_start + n])
        param[n:].zero_()  # the padding rows past the vocabulary

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection split by vocabulary rows, like the embedding (and tied to it when
    the model ties them): each rank computes the logits of its vocabulary range."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.packed_weight = None  # a CPU's prepacked copy of the weight (``cpu_gemm``)
        self.panel_weight = None  # and its panels for few rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(self, hidden)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
