"""The GPU check script (tools/gpu_check.sh, minivllm.benchmarks.gpu_check): its quick mode end to
end on whatever device is here, and the pieces that decide its verdicts."""

import json
import os
import subprocess
import sys
import time

import pytest

from minivllm.benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- verdicts ------------------------------------------------------------------------------------
def test_judge_greedy_accepts_equal_tokens_and_near_ties_only():
    assert gpu_check.judge_greedy([5, 6, 7], [5, 6, 7], [1.0, 1.0, 1.0], 1e-3)["ok"]
    # diverging where the reference's top-2 logits were 1e-4 apart: a near-tie, ok
    tie = gpu_check.judge_greedy([5, 9, 1], [5, 6, 7], [1.0, 1e-4, 1.0], 1e-3)
    assert tie["ok"] and tie["near_tie_at"] == 1 and tie["matching"] == 1
    # diverging where the reference was sure: a failure
    wrong = gpu_check.judge_greedy([5, 9, 1], [5, 6, 7], [1.0, 0.5, 1.0], 1e-3)
    assert not wrong["ok"] and wrong["near_tie_at"] is None
    # stopping early (an EOS the reference did not produce) is a failure too
    assert not gpu_check.judge_greedy([5, 6], [5, 6, 7], [1.0] * 3, 1e-3)["ok"]


def _sleep_forever():
    time.sleep(60)


def _raise():
    raise ValueError("boom")


def _die():
    os._exit(3)


def test_a_phase_that_hangs_raises_or_dies_is_recorded(tmp_path):
    out = str(tmp_path / "r.json")
    start = time.monotonic()
    assert gpu_check.run_in_child(_sleep_forever, 1.0, out)["verdict"] == "timeout"
    assert time.monotonic() - start < 10
    raised = gpu_check.run_in_child(_raise, 30, out)
    assert raised["verdict"] == "error" and "boom" in raised["figure"]
    assert "ValueError" in raised["details"]["traceback"]
    died = gpu_check.run_in_child(_die, 30, out)
    assert died["verdict"] == "error" and "exit code 3" in died["figure"]
    ok = gpu_check.run_in_child(lambda: {"verdict": "pass", "figure": "x", "vs_peak": "-"}, 30, out)
    assert ok["verdict"] == "pass"


def test_report_is_one_table_with_a_row_per_phase(tmp_path):
    result = {"command": "c", "quick": True, "wall_s": 1.0, "machine": {"date": "d"},
              "peaks": {"flops": 2e12, "bytes_per_s": 3e9},
              "phases": {"peaks": {"verdict": "pass", "figure": "a|b", "vs_peak": "-"},
                         "kernels": {"verdict": "fail", "figure": "1/2 checks", "vs_peak": "50%"}}}
    path = str(tmp_path / "report.md")
    gpu_check.write_report(path, result)
    rows = [line for line in open(path).read().splitlines() if line.startswith("| ")]
    assert rows[0] == "| phase | verdict | figure | vs peak |"
    assert rows[1:] == ["| peaks | pass | a/b | - |", "| kernels | fail | 1/2 checks | 50% |"]


# -- the whole script, quick mode ----------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_quick_mode_runs_every_phase(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "WHEEL_DIR": str(tmp_path / "no-wheels")}  # no install step here
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--quick"],
                          capture_output=True, text=True, env=env, timeout=900)
    out = tmp_path / "out"
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    phases = result["phases"]
    assert result["quick"] and list(phases) == list(gpu_check.PHASES)
    cuda = "gpu" in result["machine"]
    for name, section in phases.items():
        expected = {"pass", "skipped"} if name == "tests" and not cuda else {"pass"}
        assert section["verdict"] in expected, (name, section)
    report = (out / "report.md").read_text()
    for name in gpu_check.PHASES:
        assert f"| {name} | {phases[name]['verdict']} |" in report
    assert result["peaks"]["flops"] > 0 and result["peaks"]["bytes_per_s"] > 0
    tests = phases["tests"]["details"]
    assert tests["exit_code"] == 0 and tests["tests"] > 0 and (out / "gpu-tests.xml").exists()
    kernels = phases["kernels"]["details"]
    assert len(kernels["checks"]) >= 12 and not kernels["failed"]
    assert {c["check"].split()[0] for c in kernels["checks"]} >= {
        "decode", "prefill", "reshape_and_cache", "rms_norm+residual", "silu_and_mul", "rotary"}
    e2e = phases["e2e"]["details"]
    assert len(e2e) == 3 and all(a["triton_equals_torch"] for a in e2e.values())
    graphs = phases["cuda_graphs"]["details"]
    # graphs (on a CPU: their padded static-buffer path) ran, eager did not, same tokens
    assert graphs["graph_path_used"] and graphs["eager_has_no_graphs"] and graphs["tokens_equal"]
    assert cuda == bool(graphs["captured_sizes"])
    assert phases["compile"]["details"]["tokens_equal"]
    serve = phases["serve"]["details"]
    assert serve["stream"]["chunks"] >= 2 and serve["bench"]["completed"] == 4
    assert serve["bench"]["failed"] == 0
    tput = phases["throughput"]["details"]
    assert tput["minivllm_output_tokens"] == tput["requested_output_tokens"]
    assert tput["transformers"]["generated_tokens"] >= tput["requested_output_tokens"]
    tp = phases["tp"]["details"]
    assert tp["backend"] == ("nccl" if cuda else "gloo") and tp["all_reduce_identity"]
    # the notebook runner wrote the executed notebook with its outputs into $OUT
    nb = json.loads((out / "notebooks" / "99_quick.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]

    def text(x):  # nbformat stores multi-line strings as lists of lines
        return "".join(x) if isinstance(x, list) else x

    assert text(code[0]["outputs"][-1]["data"]["text/plain"]) == "42"
    printed = "".join(text(o.get("text", "")) for o in code[1]["outputs"])
    assert "ran 42" in printed and "a quick check" in printed
