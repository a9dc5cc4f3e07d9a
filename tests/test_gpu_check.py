"""The GPU check script itself runs end to end (tiny shapes, on whatever device is here)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_check_quick_mode_runs_and_writes_every_section(tmp_path):
    # the GPU-marked tests all live in test_gpu.py (skipped here without CUDA); looking only
    # there spares importing every test module a second time
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path),
           "GPU_TEST_PATHS": os.path.join("tests", "test_gpu.py")}
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--quick",
                           "--num-prompts", "4"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["quick"] and set(result["phases"]) == {"kernels", "e2e", "decode_steps",
                                                          "decode_roofline", "overhead",
                                                          "correctness"}
    for name, section in result["phases"].items():
        assert "error" not in section, (name, section.get("traceback"))
    phases = result["phases"]
    assert {r["context"] for r in phases["kernels"]["decode"]} == {64, 200}
    assert all(r["triton_seconds"] > 0 for r in phases["kernels"]["prefill"])
    assert set(phases["e2e"]["runs"]) == {"cuda_graphs", "eager", "transformers"}
    assert phases["e2e"]["speedup_vs_transformers"]["cuda_graphs"] > 0
    assert phases["decode_roofline"]["step_ms"] > phases["decode_roofline"]["attention_ms"] > 0
    assert set(phases["overhead"]["by_batch"]) == {"1", "8"}
    assert phases["correctness"]["float32"]["all_match"]  # same weights, float32: same tokens
    assert (tmp_path / "gpu-tests.xml").exists()
