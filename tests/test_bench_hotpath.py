"""The hot-path benchmarks on tiny workloads: they run, and their figures add up."""

import json

from minivllm.entrypoints.cli import main


def test_bench_overhead_parts_add_up(tiny_llama, tmp_path):
    path = tmp_path / "o.json"
    assert main(["bench", "overhead", "--model", tiny_llama, "--batch-sizes", "1", "8",
                 "--steps", "3", "--warmup-steps", "2", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    for batch in ("1", "8"):
        r = result["by_batch"][batch]
        parts = sum(r[p] for p in ("schedule", "prepare_inputs", "forward", "sample", "update",
                                   "output_processing"))
        # every part runs in every step: one whose timer is lost reads 0
        assert all(r[p] > 0 for p in ("schedule", "prepare_inputs", "forward", "sample",
                                      "update", "output_processing")), r
        assert r["forward"] > r["schedule"]  # the model's work, not the bookkeeping, dominates
        assert 0 < parts <= r["step"] * 1.01 and r["step"] > 0
    assert result["host_speed"]["python_ms"] > 0 and result["host_speed"]["torch_op_us"] > 0


def test_bench_decode_roofline_reports_its_limits(tiny_llama, tmp_path):
    path = tmp_path / "d.json"
    assert main(["bench", "decode-roofline", "--model", tiny_llama, "--batch", "4",
                 "--context-range", "8", "40", "--steps", "2", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["step_ms"] > r["attention_ms"] > 0 and r["matmuls_alone_ms"] > 0
    assert r["read_bandwidth_gb_per_s"] > 0 and r["matmul_gflops_per_s"] > 0
    # 4 sequences, 2 layers, K and V, 2 KV heads of 16 dims, float32
    assert 8 + 2 <= r["mean_context"] <= 40 + 3
    assert r["kv_bytes_per_step"] == int(4 * r["mean_context"] * 2 * 2 * 2 * 16 * 4)


def test_bench_throughput_workloads_resolve():
    from argparse import Namespace

    from minivllm.benchmarks.throughput import resolve_workload

    mixed = resolve_workload(Namespace(workload="mixed", num_prompts=None, input_len_range=None,
                                       output_len_range=None, hf_batch_size=None, hf_sort=None))
    assert mixed == {"num_prompts": 48, "input_len_range": [8, 400], "output_len_range": [8, 200],
                     "hf_batch_size": 16, "hf_sort": True}
    uniform = resolve_workload(Namespace(workload="uniform", num_prompts=8, input_len_range=None,
                                         output_len_range=None, hf_batch_size=None, hf_sort=None))
    assert uniform["num_prompts"] == 8 and uniform["hf_batch_size"] == 64
