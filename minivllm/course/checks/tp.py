"""Checkers for chapter 12: tensor parallelism.

* 12.1, the row-parallel linear layer (``weight_loader``, ``forward``), runs on two real ranks:
  forked processes in a gloo group (a class defined in a notebook cell reaches them as it is),
  each loading the full weight through the learner's loader and running its input slice; both
  must return the unsharded ``x @ W.T + b``.
* 12.2, sharding q/k/v by heads, loads a tiny Llama at tensor-parallel size 2 and 4 with the
  learner's shards; its logits must equal the unsharded model's. The ranks are emulated in one
  process (a thread per rank, the collectives done in memory at a barrier); the model code is
  the engine's, unchanged.

The package's own answer (``RowParallelLinear``'s methods; ``kv_head_partition`` and the q/k/v
weight loaders) is refused while the learner's code runs.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import tempfile
import threading
import traceback
import warnings
from contextlib import contextmanager, redirect_stderr, redirect_stdout

import torch

from minivllm.course.checks.common import Delegated, Exercise, compare_tensors, fail, passed

ROW_CONVENTION = (
    "Expected (row-parallel, Megatron-style): W [out, in] is split along its input dimension; "
    "rank r of tp holds the columns W[:, r*n:(r+1)*n] (n = in / tp) and receives the same "
    "slice of x (the output of the column-parallel layer before it). Each rank computes its "
    "partial product x_r @ W_r.T, the bias is added once (on rank 0 before the all-reduce, or "
    "on every rank after it), and one all-reduce (torch.distributed.all_reduce, a sum) gives "
    "every rank the whole x @ W.T + b.")

QKV_CONVENTION = (
    "Expected: q/k/v are split by heads, along dim 0 (head h is rows h*head_dim:(h+1)*head_dim). "
    "Rank r of tp keeps query heads r*H/tp .. (r+1)*H/tp - 1 (H query heads). With at least tp "
    "KV heads, it keeps KV heads r*K/tp .. (r+1)*K/tp - 1 (K KV heads); with fewer KV heads than "
    "ranks it keeps one KV head, the one its query heads read (query head h reads KV head "
    "h // (H / K)): KV head r // (tp / K), replicated on tp / K neighbouring ranks.")


ROW_ANSWER = ("minivllm.model.parallel_layers:RowParallelLinear",)
ROW_ALLOWED = ("torch.distributed.all_reduce (or the package's tensor_model_parallel_all_reduce) "
               "and torch.nn.functional.linear")
QKV_ANSWER = ("minivllm.model.parallel_layers:kv_head_partition",
              "minivllm.model.parallel_layers:QKVParallelLinear.weight_loader",
              "minivllm.model.parallel_layers:ColumnParallelLinear.weight_loader",
              "minivllm.course.checks.tp:_heads_of")


# -- Exercise 12.1: the row-parallel linear on two gloo ranks ----------------------------------

ROW_CASES = [  # (tokens, input size, output size, bias)
    (3, 8, 6, True), (1, 16, 4, True), (5, 12, 10, False), (7, 32, 24, True), (2, 4, 8, False),
]
ROW_TIMEOUT_S = 20.0  # a rank that never joins the all-reduce makes the other wait this long


def _row_cases(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    cases = []
    for tokens, n_in, n_out, bias in ROW_CASES:
        cases.append({
            "x": torch.randn(tokens, n_in, generator=g),
            "weight": torch.randn(n_out, n_in, generator=g),
            "bias": torch.randn(n_out, generator=g) if bias else None,
        })
    return cases


def _row_rank(layer_cls, cases, rank: int, tp: int, store_path: str, conn, exercise: str) -> None:
    """One rank, in a forked process: join the group, run every case, send what came out."""
    out = io.StringIO()
    result: dict = {"rank": rank, "cases": [], "error": None}
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        from datetime import timedelta

        from minivllm.distributed import parallel_state

        store = dist.FileStore(store_path, tp)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=tp,
                                timeout=timedelta(seconds=ROW_TIMEOUT_S))
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "0"})
        parallel_state.init_distributed_environment()  # the package's all-reduce works too
        with redirect_stdout(out), redirect_stderr(out), torch.no_grad():
            for case in cases:
                n_out, n_in = case["weight"].shape
                layer = layer_cls(n_in, n_out, case["bias"] is not None, rank, tp)
                layer.weight_loader(case["weight"].clone())
                if case["bias"] is not None:
                    layer.bias.copy_(case["bias"])
                n = n_in // tp
                x = case["x"][:, rank * n:(rank + 1) * n].clone()
                y = layer(x)
                result["cases"].append({
                    "y": y.detach().clone() if isinstance(y, torch.Tensor) else y,
                    "weight": layer.weight.detach().clone(),
                })
    except Delegated as e:
        result["error"] = ("delegation", str(e))
    except NotImplementedError as e:  # an unsolved exercise: raised as such by the grader
        result["error"] = ("not_implemented", str(e))
    except BaseException:
        result["error"] = ("raised", traceback.format_exc(limit=-6))
    result["printed"] = out.getvalue()
    try:
        # plain pickle: the tensors travel by value (multiprocessing's own pickler would share
        # their memory with this process, which is about to exit)
        conn.send_bytes(pickle.dumps(result))
        conn.close()
    finally:
        os._exit(0)


def _run_ranks(layer_cls, cases, tp: int, exercise: str) -> list[dict]:
    if not hasattr(os, "fork"):
        fail(exercise, "this grader forks one process per rank, which needs Linux or macOS")
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="minivllm-tp-check-") as tmp:
        pipes, procs = [], []
        with warnings.catch_warnings():
            # Python >= 3.12 warns that forking a threaded process (a notebook kernel) may
            # deadlock the child: the child here touches none of the parent's threads' locks
            warnings.simplefilter("ignore", DeprecationWarning)
            for rank in range(tp):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_row_rank, daemon=True, args=(
                    layer_cls, cases, rank, tp, os.path.join(tmp, "store"), send, exercise))
                p.start()
                send.close()
                pipes.append(recv)
                procs.append(p)
        results = []
        try:
            for rank, (recv, p) in enumerate(zip(pipes, procs)):
                if not recv.poll(ROW_TIMEOUT_S + 30):
                    fail(exercise, f"rank {rank} did not finish within {ROW_TIMEOUT_S + 30:.0f} s.")
                try:
                    results.append(pickle.loads(recv.recv_bytes()))
                except EOFError:
                    p.join(5)
                    fail(exercise, f"rank {rank}'s process died (exit code {p.exitcode}) before "
                                   "answering.")
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
    for r in results:
        if r["printed"].strip():
            print(f"[rank {r['rank']} printed]\n{r['printed'].rstrip()}")
    return results


def check_row_parallel_linear(layer_cls, exercise: str = "12.1", seed: int = 0) -> None:
    """``layer_cls(input_size, output_size, bias, tp_rank, tp_size)`` with ``weight``
    ([output_size, input_size / tp_size]), ``bias`` ([output_size] or None, set by the grader
    to the whole bias), ``weight_loader(full_weight)`` and ``forward(x_shard)``. Graded on two
    gloo ranks against ``torch.nn.functional.linear`` of the whole weight and input."""
    layer_cls = Exercise(exercise, answer=ROW_ANSWER, allowed=ROW_ALLOWED).take(
        layer_cls, "RowParallelLinear")
    tp = 2
    cases = _row_cases(seed)
    results = _run_ranks(layer_cls, cases, tp, exercise)
    for r in results:
        if r["error"] is not None:
            kind, text = r["error"]
            if kind == "delegation":
                raise Delegated(text)
            if kind == "not_implemented":
                raise NotImplementedError(text)
            hint = ""
            if any(w in text.lower() for w in ("timed out", "timeout", "closed by peer",
                                               "reset by peer")):
                hint = (" in a collective that the other rank never joined (it timed out, or "
                        "the other rank had finished): every rank must call all_reduce, the "
                        "same number of times, with a tensor of the same shape")
            fail(exercise, f"rank {r['rank']} raised{hint}:\n{text}\n{ROW_CONVENTION}")
    for i, case in enumerate(cases):
        x, w, b = case["x"], case["weight"], case["bias"]
        n_out, n_in = w.shape
        n = n_in // tp
        expected = torch.nn.functional.linear(x, w, b)
        what = (f"case {i} (x {tuple(x.shape)}, W {tuple(w.shape)}, "
                f"{'with' if b is not None else 'no'} bias)")
        got = [r["cases"][i] for r in results]
        for rank in range(tp):
            own = w[:, rank * n:(rank + 1) * n]
            held = got[rank]["weight"]
            if tuple(held.shape) != tuple(own.shape) or not torch.equal(held, own):
                fail(exercise, f"{what}: after weight_loader, rank {rank}'s weight is not "
                               f"W[:, {rank * n}:{(rank + 1) * n}] (its columns: the input slice "
                               f"it receives). {ROW_CONVENTION}")
        partials = [x[:, r * n:(r + 1) * n] @ w[:, r * n:(r + 1) * n].T for r in range(tp)]
        for rank in range(tp):
            y = got[rank]["y"]
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(expected.shape):
                compare_tensors(exercise, f"{what}, rank {rank}'s output", y, expected, 1e-5,
                                1e-5, ROW_CONVENTION)
            if torch.allclose(y, expected, atol=1e-5, rtol=1e-5):
                continue
            own = partials[rank] + (b if b is not None else 0)
            if torch.allclose(y, partials[rank], atol=1e-5) or torch.allclose(y, own, atol=1e-5):
                fail(exercise, f"{what}: rank {rank} returned only its own partial product "
                               "x_r @ W_r.T: the partial sums were never added up. Call "
                               f"torch.distributed.all_reduce on it before returning. "
                               f"{ROW_CONVENTION}")
            if b is not None and torch.allclose(y, expected + (tp - 1) * b, atol=1e-5):
                fail(exercise, f"{what}: rank {rank}'s output is x @ W.T + {tp} * b: every rank "
                               "added the bias before the all-reduce, which then summed it "
                               f"{tp} times. Add it once. {ROW_CONVENTION}")
            if b is not None and torch.allclose(y, expected - b, atol=1e-5):
                fail(exercise, f"{what}: rank {rank}'s output lacks the bias. {ROW_CONVENTION}")
            compare_tensors(exercise, f"{what}, rank {rank}'s output", y, expected, 1e-5, 1e-5,
                            ROW_CONVENTION)
    passed(exercise, f"on {tp} gloo ranks, your row-parallel layer gave every rank x @ W.T + b "
                     f"of the whole layer in {len(cases)} random cases "
                     f"({sum(c['bias'] is not None for c in cases)} with a bias).")


# -- Exercise 12.2: q/k/v shards in a real model, ranks emulated in one process ----------------

class _Collectives:
    """The all-reduce and all-gather among ``tp`` threads, one per rank, in memory."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.barrier = threading.Barrier(tp, timeout=60)
        self.slots: list = [None] * tp
        self.local = threading.local()

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # every rank has read them before the next collective writes
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        x.copy_(total)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x.contiguous()), dim=dim)


@contextmanager
def as_rank(rank: int, tp: int):
    """Build layers as rank ``rank`` of ``tp`` (they read the rank when constructed)."""
    from minivllm.distributed.parallel_state import patch_tensor_parallel_rank

    with patch_tensor_parallel_rank(rank, tp):
        yield


def load_rank_models(path: str, tp: int) -> list:
    """The model at ``path`` built and loaded as each rank of ``tp`` (float32, CPU)."""
    from minivllm.model.config import ModelConfig
    from minivllm.model.loader import load_model

    config = ModelConfig.from_pretrained(path)
    models = []
    for rank in range(tp):
        with as_rank(rank, tp):
            models.append(load_model(path, config, torch.device("cpu"), torch.float32,
                                     show_progress=False))
    return models


@torch.inference_mode()
def emulated_logits(models: list, token_ids: list[int], block_size: int = 16,
                    collectives: _Collectives | None = None) -> torch.Tensor:
    """Logits of one sequence through the rank models, run together (one thread per rank,
    collectives in memory); every rank's gathered logits must agree, rank 0's are returned."""
    from minivllm.model import parallel_layers
    from minivllm.model.standalone import sequence_logits

    tp = len(models)
    coll = collectives or _Collectives(tp)
    outputs: list = [None] * tp
    errors: list = []

    def run(rank: int) -> None:
        coll.local.rank = rank
        try:
            outputs[rank] = sequence_logits(models[rank], token_ids, block_size=block_size)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            coll.barrier.abort()

    saved = (parallel_layers.tensor_model_parallel_all_reduce,
             parallel_layers.tensor_model_parallel_all_gather)
    parallel_layers.tensor_model_parallel_all_reduce = coll.all_reduce
    parallel_layers.tensor_model_parallel_all_gather = coll.all_gather
    try:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        (parallel_layers.tensor_model_parallel_all_reduce,
         parallel_layers.tensor_model_parallel_all_gather) = saved
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    for rank in range(1, tp):
        if not torch.equal(outputs[rank], outputs[0]):
            raise RuntimeError("the ranks' gathered logits differ")
    return outputs[0]


# (name, tiny checkpoint overrides, tp): GQA split, one KV head replicated, 2 KV heads over 4 ranks
QKV_SETUPS = [
    ("4 query heads over 2 KV heads, tp=2 (KV heads split)", {}, 2),
    ("4 query heads over 1 KV head, tp=2 (the KV head replicated)", {"num_key_value_heads": 1}, 2),
    ("4 query heads over 2 KV heads, tp=4 (each KV head on 2 ranks)", {}, 4),
]


def _heads_of(rows: int, heads: int, kv: int, tp: int, rank: int, which: str):
    """(first head, number of heads, head dim) of ``which`` (q, k or v) that ``rank`` holds."""
    d = rows // (heads if which == "q" else kv)
    if which == "q":
        return rank * (heads // tp), heads // tp, d
    if kv >= tp:
        return rank * (kv // tp), kv // tp, d
    return rank // (tp // kv), 1, d  # a KV head replicated over tp // kv ranks


def _call_learner(shard_qkv, exercise, q, k, v, heads, kv, tp, rank):
    out = shard_qkv(q.clone(), k.clone(), v.clone(), heads, kv, tp, rank)
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        fail(exercise, f"shard_qkv returned {type(out).__name__}, expected a tuple "
                       f"(q_shard, k_shard, v_shard). {QKV_CONVENTION}")
    return out


def _check_shards(exercise, where, out, q, k, v, heads, kv, tp, rank) -> None:
    for name, got, full in zip("qkv", out, (q, k, v)):
        first, count, d = _heads_of(full.shape[0], heads, kv, tp, rank, name)
        expected = full[first * d:(first + count) * d]
        if isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(expected.shape) \
                and torch.equal(got, expected):
            continue
        detail = (f"expected its {name} rows {first * d}:{(first + count) * d} "
                  f"({'query' if name == 'q' else 'KV'} head{'s' if count > 1 else ''} "
                  f"{first}{f'..{first + count - 1}' if count > 1 else ''})")
        if isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(expected.shape):
            for h in range(full.shape[0] // d):
                if torch.equal(got[:d], full[h * d:(h + 1) * d]):
                    detail += f", got rows starting with head {h}'s"
                    break
        elif isinstance(got, torch.Tensor):
            detail += f" (shape {tuple(expected.shape)}), got shape {tuple(got.shape)}"
        else:
            detail += f", got {type(got).__name__}"
        fail(exercise, f"{where}, rank {rank} of {tp}: {detail}. {QKV_CONVENTION}")


def check_qkv_sharding(shard_qkv, exercise: str = "12.2", seed: int = 0) -> None:
    """``shard_qkv(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank)`` -> this rank's
    ``(q, k, v)``, each a slice of dim 0 (weights ``[rows, hidden]`` or biases ``[rows]``).

    First random tensors (weights and biases) against the convention, then a real tiny Llama
    (random weights) whose ``qkv_proj`` on every rank holds the learner's shards: its logits
    over a random sequence, at tensor-parallel size 2 or 4, must equal the unsharded model's.
    The ranks run together in this process, as threads whose collectives are summed in memory
    (see the module's docstring); the layers and the forward pass are the engine's own."""
    shard_qkv = Exercise(exercise, answer=QKV_ANSWER, allowed="tensor slicing").take(
        shard_qkv, "shard_qkv")
    from minivllm.course.checks.common import write_tiny_checkpoint
    from minivllm.model.config import ModelConfig
    from minivllm.model.loader import load_model
    from safetensors import safe_open

    g = torch.Generator().manual_seed(seed)
    cases = 0
    for heads, kv, d, tp in [(4, 2, 3, 2), (8, 2, 2, 4), (8, 8, 2, 4), (6, 1, 2, 3), (4, 4, 5, 2),
                             (8, 2, 3, 2)]:
        for bias in (False, True):
            shape = lambda rows: (rows,) if bias else (rows, 5)  # noqa: E731
            q = torch.randn(*shape(heads * d), generator=g)
            k = torch.randn(*shape(kv * d), generator=g)
            v = torch.randn(*shape(kv * d), generator=g)
            for rank in range(tp):
                where = (f"random {'biases' if bias else 'weights'}, {heads} query heads over {kv} "
                         f"KV heads of dimension {d}")
                out = _call_learner(shard_qkv, exercise, q, k, v, heads, kv, tp, rank)
                _check_shards(exercise, where, out, q, k, v, heads, kv, tp, rank)
                cases += 1

    for name, overrides, tp in QKV_SETUPS:
        path = write_tiny_checkpoint("tiny-llama-tp", initializer_range=0.5, **overrides)
        config = ModelConfig.from_pretrained(path)
        full = load_model(path, config, torch.device("cpu"), torch.float32, show_progress=False)
        ids = torch.randint(3, config.vocab_size, (12,), generator=g).tolist()
        expected = emulated_logits([full], ids)
        models = load_rank_models(path, tp)
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
            for i in range(config.num_hidden_layers):
                prefix = f"model.layers.{i}.self_attn."
                q, k, v = (f.get_tensor(prefix + f"{p}_proj.weight") for p in "qkv")
                for rank, model in enumerate(models):
                    out = _call_learner(shard_qkv, exercise, q, k, v, heads, kv, tp, rank)
                    _check_shards(exercise, f"{name}, layer {i}", out, q, k, v, heads, kv, tp,
                                  rank)
                    param = model.model.layers[i].self_attn.qkv_proj.weight
                    with torch.no_grad():
                        param.fill_(float("nan"))  # only the learner's shards count
                        param.copy_(torch.cat(list(out)))
        got = emulated_logits(models, ids)
        compare_tensors(exercise, f"{name}: the logits of the model loaded with your shards",
                        got, expected, 1e-4, 1e-4, QKV_CONVENTION)
        if not torch.equal(got.argmax(-1), expected.argmax(-1)):
            fail(exercise, f"{name}: the greedy tokens differ from the unsharded model's. "
                           f"{QKV_CONVENTION}")
    passed(exercise, f"your shards matched the convention in {cases} random cases, and a tiny "
                     f"Llama loaded with them gave the unsharded model's logits at "
                     f"{'; '.join(n for n, _, _ in QKV_SETUPS)}.")
