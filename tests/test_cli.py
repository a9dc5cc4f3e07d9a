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


def test_generate_chat_prints_text_from_the_bundled_model():
    out = _run("generate", "--chat", "What is the capital of France?", "--max-tokens", "24")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


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
