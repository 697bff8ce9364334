"""`gapless doctor --nccl`: the all-reduce measurement, on the gloo path with 2 CPU processes (small sizes)."""
import pytest
import torch

from gapless.diagnosis.nccl import bus_factor, format_allreduce, run_allreduce


def test_bus_factor_is_nccl_tests_definition():
    assert bus_factor(2) == 1.0 and bus_factor(8) == 1.75  # 2 (n - 1) / n


def test_gloo_allreduce_two_processes():
    sizes = [4 << 10, 64 << 10]
    result = run_allreduce("gloo", 2, sizes)
    assert result["ranks"] == 2 and [r["bytes"] for r in result["rows"]] == sizes
    for r in result["rows"]:
        assert r["time_s"] > 0 and r["algbw_GBps"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(2))
    text = format_allreduce(result, (10.0, "test link"))
    assert "64 KiB" in text and "against 10 GB/s per direction for test link" in text


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has several GPUs")
def test_nccl_with_one_gpu_or_none_says_so():
    result = run_allreduce("nccl", None, [1 << 20])
    assert result["rows"] == [] and "needs two or more GPUs" in result["note"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_nccl_allreduce_on_gpus():
    result = run_allreduce("nccl", None, [1 << 20, 64 << 20])
    assert result["ranks"] == torch.cuda.device_count() and result["rows"][-1]["busbw_GBps"] > 1.0


def test_doctor_nccl_command_on_gloo(capsys):
    from gapless.cli import main

    assert main(["doctor", "--nccl", "--backend", "gloo", "--procs", "2", "--max-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "gloo, 2 ranks" in out and "1 MiB" in out and "peak busbw" in out
