"""Chapter 12's graders: 12.1, the row-parallel linear on two forked gloo ranks; 12.2, q/k/v
shards by heads, then in a tiny Llama at tp 2 and 4, its ranks emulated as threads."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import tempfile
import threading
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import torch

from minivllm.course.checks.common import Delegated, Exercise, close, write_tiny_checkpoint

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

ROW_CASES = [  # (tokens, input size, output size, bias)
    (3, 8, 6, True), (1, 16, 4, True), (5, 12, 10, False), (7, 32, 24, True), (2, 4, 8, False),
]
ROW_TP = 2
ROW_TIMEOUT_S = 20.0  # a rank that never joins the all-reduce makes the other wait this long
NEVER_JOINED = (" in a collective that the other rank never joined (it timed out, or the other "
                "rank had finished): every rank must call all_reduce, the same number of times, "
                "with a tensor of the same shape")
LEFT_ALONE = ("timed out", "timeout", "closed by peer", "reset by peer")  # the other rank left
QKV_CASES = [(4, 2, 3, 2), (8, 2, 2, 4), (8, 8, 2, 4), (6, 1, 2, 3), (4, 4, 5, 2), (8, 2, 3, 2)]
QKV_SETUPS = [  # (name, tiny checkpoint overrides, tp)
    ("4 query heads over 2 KV heads, tp=2 (KV heads split)", {}, 2),
    ("4 query heads over 1 KV head, tp=2 (the KV head replicated)", {"num_key_value_heads": 1}, 2),
    ("4 query heads over 2 KV heads, tp=4 (each KV head on 2 ranks)", {}, 4),
]


# -- 12.1 ----------------------------------------------------------------------------------------

def _row_rank(layer_cls, cases, rank: int, store_path: str, conn) -> None:
    """One rank, in a forked process: join the group, run every case, send what came out."""
    from datetime import timedelta

    import torch.distributed as dist

    from minivllm.distributed import parallel_state

    out = io.StringIO()
    result: dict = {"rank": rank, "cases": [], "error": None}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, ROW_TP), rank=rank,
                                world_size=ROW_TP, timeout=timedelta(seconds=ROW_TIMEOUT_S))
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(ROW_TP),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"})
        parallel_state.init_distributed_environment()  # the package's all-reduce works too
        with redirect_stdout(out), redirect_stderr(out), torch.no_grad():
            for x, weight, bias in cases:
                layer = layer_cls(weight.shape[1], weight.shape[0], bias is not None, rank, ROW_TP)
                layer.weight_loader(weight.clone())
                if bias is not None:
                    layer.bias.copy_(bias)
                y = layer(x.chunk(ROW_TP, dim=1)[rank].clone())
                result["cases"].append({"y": y.detach().clone() if torch.is_tensor(y) else y,
                                        "weight": layer.weight.detach().clone()})
    except (Delegated, NotImplementedError) as e:  # raised as such by the grader
        result["error"] = (Delegated if isinstance(e, Delegated) else NotImplementedError, str(e))
    except BaseException:  # noqa: BLE001 - reported by the grader
        result["error"] = (None, traceback.format_exc(limit=-6))
    result["printed"] = out.getvalue()
    try:  # plain pickle: the tensors travel by value, not in memory shared with a dying process
        conn.send_bytes(pickle.dumps(result))
        conn.close()
    finally:
        os._exit(0)


def _run_ranks(ex: Exercise, layer_cls, cases) -> list[dict]:
    if not hasattr(os, "fork"):
        ex.fail("this grader forks one process per rank, which needs Linux or macOS")
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="minivllm-tp-check-") as tmp:
        pipes, procs, results = [], [], []
        with warnings.catch_warnings():  # forking a threaded kernel: the child takes no lock
            warnings.simplefilter("ignore", DeprecationWarning)
            for rank in range(ROW_TP):
                recv, send = ctx.Pipe(duplex=False)
                procs.append(ctx.Process(target=_row_rank, daemon=True, args=(
                    layer_cls, cases, rank, os.path.join(tmp, "store"), send)))
                procs[-1].start()
                send.close()
                pipes.append(recv)
        try:
            for rank, (recv, p) in enumerate(zip(pipes, procs)):
                if not recv.poll(ROW_TIMEOUT_S + 30):
                    ex.fail(f"rank {rank} did not finish within {ROW_TIMEOUT_S + 30:.0f} s.")
                try:
                    results.append(pickle.loads(recv.recv_bytes()))
                except EOFError:
                    p.join(5)
                    ex.fail(f"rank {rank}'s process died (exit code {p.exitcode}) before "
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
    raise_first_cause(ex, results)
    return results


def raise_first_cause(ex: Exercise, results: list[dict]) -> None:
    """Raise the ranks' failure, the cause first, not a rank that failed only because the other
    left a collective it then waited in (a timeout, a closed peer)."""
    failed = [(r, r["error"][0] is None and any(w in r["error"][1].lower() for w in LEFT_ALONE))
              for r in results if r["error"] is not None]
    if not failed:
        return
    r, left_alone = min(failed, key=lambda f: (f[1], f[0]["error"][0] is None))
    kind, text = r["error"]
    if kind is not None:
        raise kind(text)
    ex.fail(f"rank {r['rank']} raised{NEVER_JOINED if left_alone else ''}:\n{text}")


def check_row_parallel_linear(layer_cls, exercise: str = "12.1", seed: int = 0) -> None:
    """``layer_cls(input_size, output_size, bias, tp_rank, tp_size)`` with ``weight``, ``bias``,
    ``weight_loader(full_weight)`` and ``forward(x_shard)``, on two gloo ranks."""
    ex = Exercise(exercise, ROW_CONVENTION, ROW_ANSWER, ROW_ALLOWED)
    layer_cls = ex.take(layer_cls, "RowParallelLinear")
    g = torch.Generator().manual_seed(seed)
    cases = [(torch.randn(tokens, n_in, generator=g), torch.randn(n_out, n_in, generator=g),
              torch.randn(n_out, generator=g) if bias else None)
             for tokens, n_in, n_out, bias in ROW_CASES]
    results = _run_ranks(ex, layer_cls, cases)
    for i, (x, w, b) in enumerate(cases):
        expected = torch.nn.functional.linear(x, w, b)
        what = (f"case {i} (x {tuple(x.shape)}, W {tuple(w.shape)}, "
                f"{'with' if b is not None else 'no'} bias)")
        n, bias = w.shape[1] // ROW_TP, b if b is not None else 0
        for rank, r in enumerate(results):
            own, held = w[:, rank * n:(rank + 1) * n], r["cases"][i]["weight"]
            if tuple(held.shape) != tuple(own.shape) or not torch.equal(held, own):
                ex.fail(f"{what}: after weight_loader, rank {rank}'s weight is not "
                        f"W[:, {rank * n}:{(rank + 1) * n}] (its columns: the input slice it "
                        f"receives).")
        for rank, r in enumerate(results):
            partial = x[:, rank * n:(rank + 1) * n] @ w[:, rank * n:(rank + 1) * n].T
            mistakes = [
                (lambda y: close(y, partial, 1e-5, 1e-5) or close(y, partial + bias, 1e-5, 1e-5),
                 f"rank {rank} returned only its own partial product x_r @ W_r.T: the partial "
                 "sums were never added up. Call torch.distributed.all_reduce on it before "
                 "returning."),
                (lambda y: b is not None and close(y, expected + (ROW_TP - 1) * b, 1e-5, 1e-5),
                 f"rank {rank}'s output is x @ W.T + {ROW_TP} * b: every rank added the bias "
                 f"before the all-reduce, which then summed it {ROW_TP} times. Add it once."),
                (lambda y: b is not None and close(y, expected - b, 1e-5, 1e-5),
                 f"rank {rank}'s output lacks the bias."),
            ]
            ex.compare_tensors(f"{what}, rank {rank}'s output", r["cases"][i]["y"], expected,
                               1e-5, 1e-5, mistakes=mistakes)
    ex.passed(f"on {ROW_TP} gloo ranks, your row-parallel layer gave every rank x @ W.T + b "
              f"of the whole layer in {len(cases)} random cases "
              f"({sum(c[2] is not None for c in cases)} with a bias).")


# -- 12.2 ----------------------------------------------------------------------------------------

def _load(path: str, rank: int = 0, tp: int = 1):
    """The model at ``path`` built and loaded as rank ``rank`` of ``tp`` (float32, CPU)."""
    from minivllm.distributed.parallel_state import patch_tensor_parallel_rank
    from minivllm.model.config import ModelConfig
    from minivllm.model.loader import load_model

    with patch_tensor_parallel_rank(rank, tp):
        return load_model(path, ModelConfig.from_pretrained(path), torch.device("cpu"),
                          torch.float32, show_progress=False)


@torch.inference_mode()
def _emulated_logits(models: list, token_ids: list[int]) -> torch.Tensor:
    """Logits of one sequence through the rank models on one thread each, their collectives done
    in memory; every rank's logits must agree, rank 0's are returned."""
    from minivllm.model import parallel_layers
    from minivllm.model.standalone import sequence_logits

    tp = len(models)
    barrier, local = threading.Barrier(tp, timeout=60), threading.local()
    slots, outputs, errors = [None] * tp, [None] * tp, []

    def exchange(x: torch.Tensor) -> list[torch.Tensor]:
        slots[local.rank] = x.clone()
        barrier.wait()
        parts = list(slots)
        barrier.wait()  # every rank has read them before the next collective writes
        return parts

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        return x.copy_(torch.stack(exchange(x)).sum(0))

    def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(exchange(x.contiguous()), dim=dim)

    def run(rank: int) -> None:
        local.rank = rank
        try:
            outputs[rank] = sequence_logits(models[rank], token_ids, block_size=16)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
            barrier.abort()

    with mock.patch.multiple(parallel_layers, tensor_model_parallel_all_reduce=all_reduce,
                             tensor_model_parallel_all_gather=all_gather):
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    if any(not torch.equal(out, outputs[0]) for out in outputs[1:]):
        raise RuntimeError("the ranks' gathered logits differ")
    return outputs[0]


def _heads_of(rows: int, heads: int, kv: int, tp: int, rank: int, which: str):
    """(first head, number of heads, head dim) of ``which`` (q, k or v) that ``rank`` holds."""
    d = rows // (heads if which == "q" else kv)
    if which == "q":
        return rank * (heads // tp), heads // tp, d
    if kv >= tp:
        return rank * (kv // tp), kv // tp, d
    return rank // (tp // kv), 1, d  # a KV head replicated over tp // kv ranks


def _shards(ex: Exercise, shard_qkv, where: str, qkv, heads: int, kv: int, tp: int, rank: int):
    """The learner's shards of ``qkv`` for ``rank``, checked against the convention."""
    out = shard_qkv(*(t.clone() for t in qkv), heads, kv, tp, rank)
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        ex.fail(f"shard_qkv returned {type(out).__name__}, expected a tuple "
                f"(q_shard, k_shard, v_shard).")
    for name, got, full in zip("qkv", out, qkv):
        first, count, d = _heads_of(full.shape[0], heads, kv, tp, rank, name)
        expected = full[first * d:(first + count) * d]
        same_shape = torch.is_tensor(got) and tuple(got.shape) == tuple(expected.shape)
        if same_shape and torch.equal(got, expected):
            continue
        detail = (f"expected its {name} rows {first * d}:{(first + count) * d} "
                  f"({'query' if name == 'q' else 'KV'} head{'s' if count > 1 else ''} "
                  f"{first}{f'..{first + count - 1}' if count > 1 else ''})")
        if same_shape:
            heads_got = [h for h in range(full.shape[0] // d)
                         if torch.equal(got[:d], full[h * d:(h + 1) * d])]
            detail += f", got rows starting with head {heads_got[0]}'s" if heads_got else ""
        elif torch.is_tensor(got):
            detail += f" (shape {tuple(expected.shape)}), got shape {tuple(got.shape)}"
        else:
            detail += f", got {type(got).__name__}"
        ex.fail(f"{where}, rank {rank} of {tp}: {detail}.")
    return out


def check_qkv_sharding(shard_qkv, exercise: str = "12.2", seed: int = 0) -> None:
    """``shard_qkv(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank)`` -> this rank's
    ``(q, k, v)``: on random weights and biases, then in a tiny Llama."""
    from safetensors import safe_open

    ex = Exercise(exercise, QKV_CONVENTION, QKV_ANSWER, allowed="tensor slicing")
    shard_qkv = ex.take(shard_qkv, "shard_qkv")
    g = torch.Generator().manual_seed(seed)
    for heads, kv, d, tp in QKV_CASES:
        for bias in (False, True):
            columns = () if bias else (5,)  # biases [rows], weights [rows, hidden]
            qkv = [torch.randn(n * d, *columns, generator=g) for n in (heads, kv, kv)]
            where = (f"random {'biases' if bias else 'weights'}, {heads} query heads over {kv} "
                     f"KV heads of dimension {d}")
            for rank in range(tp):
                _shards(ex, shard_qkv, where, qkv, heads, kv, tp, rank)
    for name, overrides, tp in QKV_SETUPS:
        path = write_tiny_checkpoint("tiny-llama-tp", initializer_range=0.5, **overrides)
        full = _load(path)
        config = full.config
        ids = torch.randint(3, config.vocab_size, (12,), generator=g).tolist()
        expected = _emulated_logits([full], ids)
        models = [_load(path, rank, tp) for rank in range(tp)]
        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
            for i in range(config.num_hidden_layers):
                qkv = [f.get_tensor(f"model.layers.{i}.self_attn.{p}_proj.weight") for p in "qkv"]
                for rank, model in enumerate(models):
                    out = _shards(ex, shard_qkv, f"{name}, layer {i}", qkv,
                                  config.num_attention_heads, config.num_key_value_heads, tp, rank)
                    param = model.model.layers[i].self_attn.qkv_proj.weight
                    with torch.no_grad():
                        param.fill_(float("nan"))  # only the learner's shards count
                        param.copy_(torch.cat(list(out)))
        got = _emulated_logits(models, ids)
        ex.compare_tensors(f"{name}: the logits of the model loaded with your shards", got,
                           expected, 1e-4, 1e-4)
        if not torch.equal(got.argmax(-1), expected.argmax(-1)):
            ex.fail(f"{name}: the greedy tokens differ from the unsharded model's.")
    cases = 2 * sum(tp for *_, tp in QKV_CASES)  # weights and biases, every rank
    ex.passed(f"your shards matched the convention in {cases} random cases, and a tiny "
              f"Llama loaded with them gave the unsharded model's logits at "
              f"{'; '.join(n for n, _, _ in QKV_SETUPS)}.")
