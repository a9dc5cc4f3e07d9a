"""The ``minivllm`` command, run as a user runs it."""

import subprocess
import sys


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands():
    out = _run("--help")
    assert out.returncode == 0
    assert "generate" in out.stdout and "bench" in out.stdout


def test_generate_chat_prints_text_from_the_bundled_model(bundled_path):
    out = _run("generate", "--chat", "What is the capital of France?", "--max-tokens", "24")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    first, second = out.stdout.splitlines()[:2]
    assert first.startswith("minivllm generate: starting")  # before torch is imported
    assert second == f"minivllm generate: model SmolLM2-135M-Instruct in {bundled_path}"


def test_import_minivllm_does_not_import_torch():
    code = "import sys, minivllm; assert 'torch' not in sys.modules; print(minivllm.SamplingParams)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SamplingParams" in out.stdout


def test_generate_bad_flag_value_is_a_clear_error(tiny_llama):
    out = _run("generate", "hi", "--model", tiny_llama, "--max-tokens", "0")
    assert out.returncode == 2
    assert "max_tokens" in out.stderr and "Traceback" not in out.stderr


def test_bench_throughput_small(tiny_llama, tmp_path):
    import json

    path = tmp_path / "t.json"
    out = _run("bench", "throughput", "--model", tiny_llama, "--num-prompts", "4",
               "--input-len-range", "8", "16", "--output-len-range", "4", "8", "--compare-hf",
               "--json", str(path))
    assert out.returncode == 0, out.stderr
    result = json.loads(path.read_text())
    assert result["speedup_vs_transformers"] > 0 and result["output_tokens"] >= 16


def _assert_png(path) -> None:
    """``--plot`` wrote a PNG image with a picture in it, not an empty canvas."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[1] > 500 and pixels.std() > 0.05, (path, pixels.shape, pixels.std())


def test_bench_long_prompt_and_shared_prefix_small(tiny_llama, tmp_path):
    import json

    lp = tmp_path / "lp.json"
    out = _run("bench", "long-prompt", "--model", tiny_llama, "--num-chats", "3",
               "--long-prompt-len", "64", "--chunk-sizes", "8", "--steady-steps", "3",
               "--json", str(lp), "--plot", str(tmp_path / "lp.png"))
    assert out.returncode == 0, out.stderr
    _assert_png(tmp_path / "lp.png")
    runs = json.loads(lp.read_text())["runs"]
    assert set(runs) == {"v0", "v1-chunk8"}
    assert all(r["window_steps"] > 0 and r["tpot_p99_ms"] > 0 for r in runs.values())
    assert runs["v0"]["window_steps"] < runs["v1-chunk8"]["window_steps"]  # v1 chunks the prompt
    sp = tmp_path / "sp.json"
    out = _run("bench", "shared-prefix", "--model", tiny_llama, "--num-requests", "4",
               "--prefix-len", "64", "--json", str(sp), "--plot", str(tmp_path / "sp.png"))
    assert out.returncode == 0, out.stderr
    _assert_png(tmp_path / "sp.png")
    r = json.loads(sp.read_text())
    assert r["same_tokens"] and r["caching_on"]["peak_kv_blocks_used"] == r["expected_blocks_shared"]
    assert r["caching_off"]["peak_kv_blocks_used"] > r["caching_on"]["peak_kv_blocks_used"]


def test_bench_sim_small(tmp_path):
    out = _run("bench", "sim", "--num-decoding", "8", "--long-prompt-len", "2048",
               "--chunk-sizes", "256", "--num-sessions", "20", "--system-prompt-len", "2000")
    assert out.returncode == 0, out.stderr
    assert "v1-256" in out.stdout and "system prompt" in out.stdout


def test_every_engine_argument_has_its_flag_and_parses_back():
    """The flags are generated from EngineArgs: each field (but the injectable classes) has one,
    named as vLLM names it, and a command line round-trips to the same EngineArgs."""
    import dataclasses

    from minivllm.config import EngineArgs
    from minivllm.entrypoints.cli import build_parser

    parser = build_parser()
    for command in (["generate"], ["serve"], ["bench", "throughput"]):
        args = parser.parse_args(command)
        fields = {f.name for f in dataclasses.fields(EngineArgs) if not f.name.endswith("_cls")}
        missing = {name for name in fields if not hasattr(args, name)}
        assert not missing, (command, missing)
        parsed = EngineArgs.from_cli_args(args)
        expected = EngineArgs(**({"multiprocess": True, "trace_steps": 0}
                                 if command == ["serve"] else {}))
        assert parsed == expected, command
    args = parser.parse_args(["generate", "--max-num-seqs", "7", "--no-enable-prefix-caching",
                              "--kv-cache-memory-bytes", "1000", "--gpu-memory-utilization", "0.5",
                              "--prefix-caching-hash-algo", "xxhash", "--tokenizer", "t",
                              "--revision", "r", "--skip-tokenizer-init"])
    parsed = EngineArgs.from_cli_args(args)
    assert (parsed.max_num_seqs, parsed.enable_prefix_caching, parsed.kv_cache_memory_bytes,
            parsed.gpu_memory_utilization, parsed.prefix_caching_hash_algo, parsed.tokenizer,
            parsed.revision, parsed.skip_tokenizer_init) == (7, False, 1000, 0.5, "xxhash", "t",
                                                              "r", True)
