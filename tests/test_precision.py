"""`gapless compare-precision` on the CPU with the demo's tiny model: the same seeds and batches under fp32, TF32
(the same computation on a CPU), bf16, and fp16 with the dynamic loss scaler (gapless.train.loss_scale)."""
import json
import re

import pytest
import torch

from gapless.cli import main
from gapless.diagnosis.precision import compare_precision, differences, final_loss, format_comparison, tf32
from test_doctor import demo  # noqa: F401  (the demo's tiny model and data, a module fixture)


@pytest.fixture(scope="module")
def config(demo):
    return demo.path


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_tf32_flags_are_restored():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    with tf32(True):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before


def test_compare_on_cpu(config, tmp_path, one_thread):
    result = compare_precision(config, steps=4, out=tmp_path)
    rows = {r["variant"]: r for r in result["variants"]}
    assert set(rows) == {"fp32", "tf32", "bf16", "fp16"}
    # fp16 ran with its loss scaler: 10 mantissa bits, close to fp32; the scale (2^16 at the start) is reported
    assert rows["fp16"]["status"] == "ran" and sorted(rows["fp16"]["losses"]) == [1, 2, 3, 4]
    assert 0 < rows["fp16"]["max_rel_diff"] < 0.05, rows["fp16"]
    # 4 steps: at most 4 halvings from 2^16
    assert 2.0 ** 12 <= rows["fp16"]["loss_scale"] <= 2.0 ** 16 and "skipped_steps" in rows["fp16"]
    assert rows["fp16"]["note"].startswith(f"loss scale {rows['fp16']['loss_scale']:g}, ")
    assert sorted(rows["fp32"]["losses"]) == [1, 2, 3, 4] and rows["fp32"]["max_abs_diff"] == 0.0
    # no TF32 on a CPU: the same computation, bit for bit
    assert rows["tf32"]["losses"] == rows["fp32"]["losses"] and "no TF32" in rows["tf32"]["note"]
    # bf16 changes the numbers a little (8 mantissa bits: ~0.4% relative per op), not the training
    assert 0 < rows["bf16"]["max_rel_diff"] < 0.05, rows["bf16"]
    assert all(rows[v]["tokens_per_s"] > 0 for v in ("fp32", "tf32", "bf16", "fp16"))
    page = (tmp_path / "precision.html").read_text()
    assert "data:image/png;base64," in page and "bf16" in page
    assert json.loads((tmp_path / "precision.json").read_text())["steps"] == 4


def test_a_step_without_a_loss_is_left_out_not_compared():
    """fp16's scaler skipped step 3 (its window's loss is NaN): the differences are over steps 1, 2 and 4, and the
    row says one step was left out, instead of a NaN that max() would hide or spread."""
    ref = {1: 2.0, 2: 1.5, 3: 1.2, 4: 1.0}
    fp16 = {1: 2.0, 2: 1.53, 3: float("nan"), 4: 0.99}
    d = differences(fp16, ref)
    assert d["max_abs_diff"] == pytest.approx(0.03) and d["max_rel_diff"] == pytest.approx(0.02)
    assert d["final_diff"] == pytest.approx(-0.01) and d["steps_without_loss"] == 1
    assert final_loss({**fp16, 4: float("nan")}) == 1.53
    row = {"variant": "fp16", "status": "ran", "losses": fp16, "tokens_per_s": 10.0, "speedup": 1.0,
           "attn_backend": "sdpa", "compile": False, "note": "loss scale 32768, 1 skipped steps", **d}
    text = format_comparison({"steps": 4, "variants": [row]})
    assert "0.9900" in text and "1 logged step(s) without a loss (every step skipped), left out; loss scale" in text


def test_cli_subset_and_bad_variant(config, tmp_path, capsys, one_thread):
    assert main(["compare-precision", str(config), "--steps", "2", "--out", str(tmp_path), "--variants",
                 "fp32,fp16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^fp16 .* loss scale \d+, \d+ skipped steps", out, flags=re.M) and "precision.html" in out
    assert "bf16" not in out.split("differences are against")[0]  # only the variants asked for
    assert main(["compare-precision", str(config), "--variants", "fp8"]) == 2
