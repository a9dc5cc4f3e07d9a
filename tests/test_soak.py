"""A short ``minivllm bench soak``: mixed traffic (streaming, non-streaming, disconnecting,
aborted, invalid) against a multi-process server on a tiny model; every valid request is
answered, every invalid one refused with a 4xx, nothing else happens, and no KV block is left
in use. (README gives the long run's figures.)"""

import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("psutil")
pytestmark = pytest.mark.slow


def test_short_soak(tiny_llama, tmp_path, capsys):
    from minivllm.entrypoints.cli import build_parser

    out = tmp_path / "soak.json"
    args = build_parser().parse_args([
        "bench", "soak", "--num-requests", "100", "--warmup-requests", "20", "--concurrency", "16",
        "--server-args", f"{tiny_llama} --max-model-len 256", "--json", str(out)])
    assert args.func(args) == 0, capsys.readouterr().out[-3000:]
    result = json.loads(out.read_text())
    outcomes = result["outcomes"]
    assert sum(outcomes.values()) == result["num_requests"] == 100
    assert "unexpected" not in outcomes, result["unexpected_examples"]
    assert outcomes.get("stream_ok", 0) > 0 and outcomes.get("full_ok", 0) > 0
    assert outcomes.get("invalid_refused", 0) > 0 and outcomes.get("disconnected", 0) > 0
    assert result["kv_blocks_used_at_end"] == 0 and result["healthy_at_end"]
    for reading in (result["rss_at_warmup"], result["rss_at_end"]):
        assert reading["server_rss_mb"] > 0 and reading["core_rss_mb"] > 0
