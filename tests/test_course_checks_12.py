"""The checkers of chapter 12: the row-parallel linear on two gloo ranks (12.1) and the q/k/v
shards of a real tiny Llama at tensor-parallel size 2 and 4 (12.2). The answers the solutions
notebook gives pass; each classic mistake fails with a CheckFailed naming the convention
broken, and an answer that hands the work to the package's own layer fails, saying why."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minivllm.course import checks
from minivllm.model import parallel_layers
from minivllm.model.parallel_layers import kv_head_partition
from tests.course_helpers import fails


class RowParallelLinear(nn.Module):
    """As in solutions/12_tensor_parallelism.ipynb."""

    def __init__(self, input_size, output_size, bias, tp_rank, tp_size):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp_size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def weight_loader(self, full_weight):
        n = self.weight.shape[1]
        self.weight.copy_(full_weight[:, self.tp_rank * n:(self.tp_rank + 1) * n])

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.bias is not None and self.tp_rank == 0:
            y = y + self.bias
        dist.all_reduce(y)
        return y


class BiasAfterAllReduce(RowParallelLinear):
    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class NoAllReduce(RowParallelLinear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)


class BiasOnEveryRank(RowParallelLinear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        dist.all_reduce(y)
        return y


class OtherRanksColumns(RowParallelLinear):
    def weight_loader(self, full_weight):
        n, r = self.weight.shape[1], self.tp_size - 1 - self.tp_rank
        self.weight.copy_(full_weight[:, r * n:(r + 1) * n])


class OnlyRankZeroReduces(RowParallelLinear):
    def forward(self, x):
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_rank == 0:
            dist.all_reduce(y)
        return y


class DelegatingLayer(RowParallelLinear):
    def forward(self, x):
        return parallel_layers.RowParallelLinear.forward(self, x)


def test_row_parallel_solution_passes(capsys):
    checks.check_row_parallel_linear(RowParallelLinear)
    checks.check_row_parallel_linear(BiasAfterAllReduce)
    assert capsys.readouterr().out.count("Exercise 12.1 passed") == 2


@pytest.mark.parametrize("answer, fragments", [
    (NoAllReduce, ["only its own partial product", "all_reduce"]),
    (BiasOnEveryRank, ["x @ W.T + 2 * b", "Add it once"]),
    (OtherRanksColumns, ["rank 0's weight is not W[:, 0:", "its columns"]),
    (OnlyRankZeroReduces, ["never joined", "every rank must call all_reduce"]),
])
def test_row_parallel_mistakes_fail_naming_the_convention(answer, fragments):
    message = fails(checks.check_row_parallel_linear, answer, *fragments, starts="Exercise 12.1: ")
    assert "Expected (row-parallel, Megatron-style)" in message


def test_row_parallel_delegation_fails_saying_why():
    fails(checks.check_row_parallel_linear, DelegatingLayer, "RowParallelLinear",
          "the package's own answer", error=checks.Delegated, starts="Exercise 12.1: ")


def shard_qkv(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank):
    """As in solutions/12_tensor_parallelism.ipynb."""
    d = q.shape[0] // num_heads
    per_rank = num_heads // tp_size
    q_shard = q[tp_rank * per_rank * d:(tp_rank + 1) * per_rank * d]
    if num_kv_heads >= tp_size:
        kv_per_rank = num_kv_heads // tp_size
        first = tp_rank * kv_per_rank
    else:
        kv_per_rank, first = 1, tp_rank // (tp_size // num_kv_heads)
    rows = slice(first * d, (first + kv_per_rank) * d)
    return q_shard, k[rows], v[rows]


def replicated_round_robin(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank):
    if num_kv_heads >= tp_size:
        return shard_qkv(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank)
    d = q.shape[0] // num_heads
    per_rank = num_heads // tp_size
    head = tp_rank % num_kv_heads  # not the head this rank's queries read
    return (q[tp_rank * per_rank * d:(tp_rank + 1) * per_rank * d], k[head * d:(head + 1) * d],
            v[head * d:(head + 1) * d])


def kv_not_split(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank):
    d = q.shape[0] // num_heads
    per_rank = num_heads // tp_size
    return q[tp_rank * per_rank * d:(tp_rank + 1) * per_rank * d], k, v


def delegating_shards(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank):
    d = q.shape[0] // num_heads
    n, first = kv_head_partition(num_kv_heads, tp_size, tp_rank)  # imported before grading
    per_rank = num_heads // tp_size
    return (q[tp_rank * per_rank * d:(tp_rank + 1) * per_rank * d], k[first * d:(first + n) * d],
            v[first * d:(first + n) * d])


def test_qkv_solution_passes(capsys):
    checks.check_qkv_sharding(shard_qkv)
    assert "Exercise 12.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("answer, fragments", [
    (replicated_round_robin, ["rank 1 of 4", "KV head 0", "got rows starting with head 1's"]),
    (kv_not_split, ["rank 0 of 2", "got shape"]),
])
def test_qkv_mistakes_fail_naming_the_convention(answer, fragments):
    message = fails(checks.check_qkv_sharding, answer, *fragments, starts="Exercise 12.2: ")
    assert "query head h reads KV head h // (H / K)" in message


def test_qkv_delegation_fails_saying_why_and_the_helper_comes_back():
    fails(checks.check_qkv_sharding, delegating_shards, "kv_head_partition",
          "the package's own answer", error=checks.Delegated, starts="Exercise 12.2: ")
    assert kv_head_partition(2, 4, 3) == (1, 1)  # restored after grading


def test_the_rank_that_failed_first_is_reported_not_the_one_left_waiting():
    """Rank 1 raising NotImplementedError leaves rank 0 in a collective ("closed by peer"),
    and rank 0's result comes first: the grader reports rank 1's error, the cause."""
    from minivllm.course.checks.tp import raise_first_cause
    from minivllm.course.grading import Exercise

    waiting = {"rank": 0, "error": (None, "RuntimeError: Connection closed by peer [::1]:1234")}
    own = {"rank": 1, "error": (NotImplementedError, "Exercise 12.1: split the rows")}
    with pytest.raises(NotImplementedError, match="split the rows"):
        raise_first_cause(Exercise("12.1"), [waiting, own])
    crashed = {"rank": 1, "error": (None, "ValueError: shapes do not match")}
    message = fails(lambda results: raise_first_cause(Exercise("12.1"), results),
                    [waiting, crashed], "rank 1 raised", "shapes do not match")
    assert "never joined" not in message
    fails(lambda results: raise_first_cause(Exercise("12.1"), results), [waiting],
          "rank 0 raised", "never joined")
    raise_first_cause(Exercise("12.1"), [{"rank": 0, "error": None}])  # nothing failed
