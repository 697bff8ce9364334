"""Checkpoints that bitsandbytes saved in 4 bits (gapless.model.prequantized): read as transformers + bitsandbytes
save them, dequantised for LoRA and full fine-tuning, kept as stored for QLoRA, exported without their
quantization_config. `write_bnb` writes the layout with gapless' own NF4 quantiser, so these run without
bitsandbytes; where it imports, the layout is checked against what transformers + bitsandbytes write."""
import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.testing import assert_close

import gapless
from gapless.config import LoraConfig, load_config
from gapless.kernels.nf4 import DYNAMIC_VALUES, NF4_VALUES, double_quantize, quantize_nf4
from gapless.model.export import copy_tokenizer_files
from gapless.model.loading import build, load_weights, read_weight_headers
from gapless.model.prequantized import fold
from gapless.model.qlora import QLoraLinear, QloraLoadHook, apply_qlora

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# bitsandbytes' FP4 values (functional.get_4bit_type("fp4")), for a checkpoint NF4 storage cannot take as stored
FP4_VALUES = (0.0, 0.0052083333, 0.6666667, 1.0, 0.3333333, 0.5, 0.1666667, 0.25,
              -0.0, -0.0052083333, -0.6666667, -1.0, -0.3333333, -0.5, -0.1666667, -0.25)


def write_bnb(source: Path, out: Path, *, nested: bool = True, storage: torch.dtype = torch.uint8,
              quant_type: str = "nf4", dtype: str = "bfloat16") -> Path:
    """`source`'s linear weights (the decoder's projections; not lm_head, as transformers skips it) saved as
    transformers + bitsandbytes save a 4-bit model: the parts of prequantized's docstring, quantised here by
    gapless.kernels.nf4 (bitsandbytes' NF4, bit for bit); FP4: the same codes under FP4's values."""
    out.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "_load_in_4bit": True,
        "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": nested, "bnb_4bit_compute_dtype": dtype,
        "bnb_4bit_quant_storage": str(storage).removeprefix("torch."), "llm_int8_skip_modules": None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    with safe_open(source / "model.safetensors", "pt") as st:
        for key in st.keys():
            w = st.get_tensor(key)
            if not key.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
                tensors[key] = w.to(getattr(torch, dtype))
                continue
            q = quantize_nf4(w.to(getattr(torch, dtype)))
            tensors[key] = q.packed.view(storage).reshape(-1, 1)
            values = NF4_VALUES if quant_type == "nf4" else FP4_VALUES
            tensors[key + ".quant_map"] = torch.tensor(values, dtype=torch.float32)
            state = {"quant_type": quant_type, "blocksize": 64, "dtype": dtype, "shape": list(w.shape)}
            if nested:
                tensors[key + ".absmax"] = q.absmax_q
                tensors[key + ".nested_absmax"] = q.absmax_scale
                tensors[key + ".nested_quant_map"] = torch.tensor(DYNAMIC_VALUES)
                state |= {"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": q.offset.item()}
            else:  # the float32 block scales
                tensors[key + ".absmax"] = _scales(q)
            tensors[key + f".quant_state.bitsandbytes__{quant_type}"] = torch.tensor(
                list(json.dumps(state).encode()), dtype=torch.uint8)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    copy_tokenizer_files(source, out)
    return out


def _scales(q) -> torch.Tensor:
    """The float32 block scales of an NF4Weight's double quantisation."""
    scale = q.absmax_scale.repeat_interleave(256)[:q.absmax_q.numel()]
    return torch.tensor(DYNAMIC_VALUES)[q.absmax_q.long()] * scale + q.offset


def expected_weight(folder: Path, key: str) -> torch.Tensor:
    """The weight `key` as the file defines it, element by element in float32: quant_map[code] * its block's scale."""
    with safe_open(folder / "model.safetensors", "pt") as st:
        parts = {k[len(key):]: st.get_tensor(k) for k in st.keys() if k.startswith(key)}
    state = json.loads(bytes(parts[next(k for k in parts if "quant_state" in k)].tolist()))
    codes = parts[""].reshape(-1).view(torch.uint8)
    nib = torch.stack([codes >> 4, codes & 15], 1).reshape(-1).long()
    absmax = parts[".absmax"]
    if ".nested_absmax" in parts:
        block = torch.arange(absmax.numel()) // state["nested_blocksize"]
        absmax = parts[".nested_quant_map"][absmax.long()] * parts[".nested_absmax"][block] + state["nested_offset"]
    w = parts[".quant_map"][nib] * absmax[torch.arange(nib.numel()) // state["blocksize"]]
    return w.view(state["shape"])


@pytest.fixture
def bnb_folder(hf_checkpoint, tmp_path):
    _, source = hf_checkpoint("llama")
    return source, write_bnb(source, tmp_path / "bnb")


@pytest.mark.parametrize("nested, storage, quant_type", [(True, torch.uint8, "nf4"), (False, torch.uint8, "nf4"),
                                                          (True, torch.bfloat16, "nf4"), (True, torch.uint8, "fp4")])
def test_loads_dequantised_as_the_file_defines_it(hf_checkpoint, tmp_path, nested, storage, quant_type):
    _, source = hf_checkpoint("llama")
    folder = write_bnb(source, tmp_path / "bnb", nested=nested, storage=storage, quant_type=quant_type)
    model = gapless.load_model(folder)  # float32
    state = model.state_dict()
    plain = gapless.load_model(source).state_dict()
    for key in state:
        if key.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
            assert torch.equal(state[key], expected_weight(folder, key)), key
            if quant_type == "nf4":  # (write_bnb's FP4 is NF4's codes under other values: far from the original)
                assert (state[key] - plain[key]).abs().max() < 0.2 * plain[key].abs().max()
        else:  # the tensors saved unquantised, as written (bfloat16, read in float32)
            assert torch.equal(state[key], plain[key].to(torch.bfloat16).float()), key
    bf16 = gapless.load_model(folder, dtype=torch.bfloat16).state_dict()
    key = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(bf16[key], state[key].to(torch.bfloat16))  # float32 math, cast last


def test_headers_fold_the_parts_into_the_weight(bnb_folder):
    source, folder = bnb_folder
    headers, stored = fold(read_weight_headers(folder))
    assert {k: v[1] for k, v in headers.items()} == {k: v[1] for k, v in read_weight_headers(source).items()}
    assert sorted(stored) == sorted(k for k in headers if k.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlora_trains_on_the_codes_the_file_holds(bnb_folder, dtype):
    """Whatever the load's dtype, a QLoRA layer's storage is the file's: the same 4-bit codes, scale codes, scales
    and offset; no weight is dequantised and quantised again."""
    _, folder = bnb_folder
    model = apply_qlora(build(folder), LoraConfig(r=4, alpha=8), dtype)
    hook = QloraLoadHook(model, torch.bfloat16)
    load_weights(model, dtype, "cpu", hook=hook)
    with safe_open(folder / "model.safetensors", "pt") as st:
        for name, layer in model.named_modules():
            if isinstance(layer, QLoraLinear):
                key = name + ".weight"
                assert torch.equal(layer.weight_packed, st.get_tensor(key).view(-1))
                assert torch.equal(layer.weight_absmax_q, st.get_tensor(key + ".absmax"))
                assert torch.equal(layer.weight_absmax_scale, st.get_tensor(key + ".nested_absmax"))
                assert layer.weight_offset.item() == json.loads(bytes(st.get_tensor(
                    key + ".quant_state.bitsandbytes__nf4").tolist()))["nested_offset"]
                assert torch.equal(layer.weight, expected_weight(folder, key).to(dtype))
    assert not hook.requantised


def test_qlora_double_quantises_a_checkpoint_without_it(hf_checkpoint, tmp_path):
    _, source = hf_checkpoint("llama")
    folder = write_bnb(source, tmp_path / "bnb", nested=False)
    model = apply_qlora(build(folder), LoraConfig(r=4, alpha=8), torch.float32)
    load_weights(model, torch.float32, "cpu", hook=QloraLoadHook(model))
    layer = model.model.layers[0].self_attn.k_proj
    with safe_open(folder / "model.safetensors", "pt") as st:
        key = "model.layers.0.self_attn.k_proj.weight"
        assert torch.equal(layer.weight_packed, st.get_tensor(key).view(-1))  # the 4-bit codes as stored
        absmax_q, scale, offset = double_quantize(st.get_tensor(key + ".absmax"))  # the scales as QLoRA's
        assert torch.equal(layer.weight_absmax_q, absmax_q) and torch.equal(layer.weight_absmax_scale, scale)
        assert (layer.weight - expected_weight(folder, key)).abs().max() < 0.01 * layer.weight.abs().max()


def test_qlora_quantises_again_what_nf4_storage_cannot_hold(hf_checkpoint, tmp_path):
    _, source = hf_checkpoint("llama")
    folder = write_bnb(source, tmp_path / "bnb", quant_type="fp4")
    model = apply_qlora(build(folder), LoraConfig(r=4, alpha=8), torch.float32)
    hook = QloraLoadHook(model)
    with pytest.warns(UserWarning, match="fp4 weights of block size 64 are dequantised and quantised again"):
        load_weights(model, torch.float32, "cpu", hook=hook)
    assert len(hook.requantised) == 2 * 7
    key = "model.layers.1.self_attn.o_proj.weight"
    want = quantize_nf4(expected_weight(folder, key))
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight_packed, want.packed)


def test_a_qlora_run_on_a_4bit_checkpoint_exports_an_adapter_and_a_plain_merged_folder(tmp_path):
    import transformers

    from gapless import demo_task
    from gapless.demo import write_base_model
    from gapless.model.lora import merge_lora
    from gapless.model.method import method_of
    from gapless.train.export import export
    from gapless.train.loop import train

    folder = write_bnb(write_base_model(tmp_path / "base", seed=0), tmp_path / "bnb")
    data = demo_task.write_jsonl(demo_task.make_examples(40, seed=1), tmp_path / "train.jsonl")
    raw = {"model": {"path": str(folder), "dtype": "bfloat16", "device": "cpu", "compile": False},
           "data": {"sources": [{"path": str(data), "format": "messages"}], "max_seq_len": 64,
                    "tokens_per_batch": 128, "cache_dir": str(tmp_path / "cache"), "num_workers": 0},
           "method": "qlora", "lora": {"r": 4, "alpha": 8}, "optim": {"lr": 1e-2},
           "train": {"steps": 2, "log_every": 1}, "output_dir": str(tmp_path / "run"), "progress": False}
    cfg = load_config(data=raw)
    run = train(cfg, out=io.StringIO())
    adapter = json.loads((run.final_dir / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]) == folder.resolve()
    trained, _ = method_of(cfg).load_final(run.final_dir, folder, torch.float32, "cpu")
    with safe_open(folder / "model.safetensors", "pt") as st:  # the run's base: the file's codes
        assert torch.equal(trained.model.layers[0].mlp.up_proj.weight_packed,
                           st.get_tensor("model.layers.0.mlp.up_proj.weight").view(-1))
    want = merge_lora(trained).state_dict()
    merged = export(run.run_dir, tmp_path / "merged", merge=True, dtype="float32")
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    name = "model.layers.0.mlp.up_proj.weight"
    assert_close(hf.state_dict()[name], want[name], atol=1e-6, rtol=0)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(hf(ids).logits, gapless.load_model(merged)(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' checkpoints are not supported"),
    ({"load_in_4bit": False, "_load_in_4bit": False, "load_in_8bit": True}, "bitsandbytes 8-bit \\(LLM.int8\\)"),
    ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type 'int4' is not one of nf4, fp4"),
    ({"quant_method": None, "group_size": 64, "bits": 4}, "an MLX-quantised checkpoint \\(4-bit, group size 64"),
])
def test_other_quantisations_are_refused_naming_the_field(bnb_folder, change, message):
    _, folder = bnb_folder
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] |= change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"config.json: quantization_config: {message}"):
        build(folder)


def _rewrite(folder: Path, edit) -> None:
    with safe_open(folder / "model.safetensors", "pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_or_wrong_part_names_the_file_and_tensor(bnb_folder):
    _, folder = bnb_folder
    key = "model.layers.1.self_attn.v_proj.weight"
    _rewrite(folder, lambda t: t.update({key + ".absmax": t[key + ".absmax"][:-1]}))
    with pytest.raises(ValueError, match=f"model.safetensors: the 4-bit weight {key} of shape \\[32, 64\\].*"
                                         f"{key}.absmax holds 31 elements"):
        gapless.load_model(folder)
    _rewrite(folder, lambda t: t.pop(key + ".nested_absmax"))
    with pytest.raises(ValueError, match=f"the 4-bit weight {key} lacks {key}.nested_absmax"):
        build(folder)
    _rewrite(folder, lambda t: t.update({key + ".quant_state.bitsandbytes__nf4": torch.tensor([1, 2], dtype=torch.uint8)}))
    with pytest.raises(ValueError, match="quant_state.bitsandbytes__nf4: not a readable bitsandbytes quant state"):
        build(folder)


def test_the_layout_is_what_transformers_and_bitsandbytes_write(hf_checkpoint, tmp_path):
    """transformers + bitsandbytes (its CPU backend) quantise and save a model; gapless reads every 4-bit weight
    as bitsandbytes dequantises it, bit for bit, and write_bnb's layout (which the tests above read) is that one."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf
    import transformers

    # rows of whole 64-weight blocks (as every real model's): where a row is 1.5 blocks (intermediate 96),
    # bitsandbytes' CPU dequantisation kernel places blocks otherwise than its quantiser and its CUDA kernel, which
    # agree with each other and with gapless (tests/test_nf4.py)
    _, source = hf_checkpoint("llama", intermediate_size=128)
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(source, quantization_config=cfg, dtype=torch.bfloat16,
                                                               device_map="cpu")
    hf.save_pretrained(tmp_path / "saved")
    ours = gapless.load_model(tmp_path / "saved", dtype=torch.bfloat16)
    for p in PROJECTIONS:
        name = f"model.layers.1.{'mlp' if p in PROJECTIONS[4:] else 'self_attn'}.{p}"
        w = hf.get_submodule(name).weight
        assert torch.equal(ours.get_submodule(name).weight, bnbf.dequantize_4bit(w.data, w.quant_state)), name
    mine = write_bnb(source, tmp_path / "mine")

    def layout(folder):
        with safe_open(folder / "model.safetensors", "pt") as st:
            return {k: (st.get_slice(k).get_dtype(), st.get_slice(k).get_shape()) for k in st.keys()
                    if "quant_state" not in k}

    assert layout(mine) == layout(tmp_path / "saved")
    saved_q = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    mine_q = json.loads((mine / "config.json").read_text())["quantization_config"]
    assert {k: saved_q[k] for k in mine_q} == mine_q


@pytest.mark.parametrize("method, quant_type, severity, says", [
    ("qlora", "nf4", "ok", "QLoRA trains on its NF4 codes as stored"),
    ("qlora", "fp4", "warning", "QLoRA dequantises them and quantises them again as NF4"),
    ("lora", "nf4", "warning", "method lora dequantises them to bfloat16 and trains the LoRA adapter on that base"),
    ("full", "nf4", "warning", "the quantisation error is in the starting point"),
])
def test_the_doctor_says_what_the_method_makes_of_a_4bit_checkpoint(hf_checkpoint, tmp_path, method, quant_type,
                                                                    severity, says):
    from gapless.diagnosis.doctor import check_quantised_base

    _, source = hf_checkpoint("llama")
    folder = write_bnb(source, tmp_path / "bnb", quant_type=quant_type)
    for path, found in ((source, 0), (folder, 1)):  # (the unquantised checkpoint: nothing to say)
        cfg = load_config(data={"model": {"path": str(path), "dtype": "bfloat16"}, "method": method,
                                "data": {"sources": [{"path": str(tmp_path / "train.jsonl")}]}})
        assert len(check_quantised_base(cfg)) == found
    (finding,) = check_quantised_base(cfg)
    assert finding.severity == severity and says in finding.detail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_straight_to_cuda_through_the_staged_reader_equals_the_host_load(bnb_folder):
    """On CUDA the parts are read by the staged reader (loading._StagedReader) in threads: the dequantised model and
    the QLoRA storage are the host load's, bit for bit."""
    _, folder = bnb_folder
    host = gapless.load_model(folder, dtype=torch.bfloat16)
    cuda = load_weights(build(folder), torch.bfloat16, "cuda", threads=4)
    for key, value in host.state_dict().items():
        assert torch.equal(cuda.state_dict()[key].cpu(), value), key
    model = apply_qlora(build(folder), LoraConfig(r=4, alpha=8), torch.bfloat16)
    hook = QloraLoadHook(model)
    load_weights(model, torch.bfloat16, "cuda", hook=hook, threads=4)
    layer = model.model.layers[1].mlp.gate_proj
    assert layer.weight_packed.is_cuda and not hook.requantised
    assert torch.equal(layer.weight.cpu(), host.model.layers[1].mlp.gate_proj.weight)


def test_an_odd_weight_with_a_ragged_last_block_dequantises_as_the_format_says():
    """15 weights: 8 bytes of codes (the last low nibble unused), one block of 15 (short of 64) and, double-quantised,
    one second-level block; bitsandbytes, where it imports, gives the same values."""
    from gapless.model.prequantized import StoredNF4

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (8,), dtype=torch.uint8, generator=gen)
    quant_map = torch.tensor(NF4_VALUES)
    nib = torch.stack([codes >> 4, codes & 15], 1).reshape(-1)[:15].long()
    plain = StoredNF4(codes, torch.tensor([0.75]), quant_map, None, None, 0.0, 64, 0, "nf4", (3, 5), torch.float32)
    assert torch.equal(plain.dequantize(), (quant_map[nib] * 0.75).view(3, 5))
    assert plain.nf4() is None  # NF4 storage holds whole 64-weight blocks: QLoRA quantises it again
    nested = StoredNF4(codes, torch.tensor([200], dtype=torch.uint8), quant_map, torch.tensor([0.5]),
                       torch.tensor(DYNAMIC_VALUES), 0.25, 64, 256, "nf4", (3, 5), torch.bfloat16)
    scale = DYNAMIC_VALUES[200] * 0.5 + 0.25
    assert torch.equal(nested.dequantize(torch.float32), (quant_map[nib] * torch.tensor(scale)).view(3, 5))
    assert nested.dequantize().dtype == torch.bfloat16
    bnbf = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(3, 5, generator=gen)
    packed, state = bnbf.quantize_4bit(w, quant_type="nf4", compress_statistics=False)
    ours = StoredNF4(packed.view(-1), state.absmax, state.code, None, None, 0.0, 64, 0, "nf4", (3, 5), torch.float32)
    assert torch.equal(ours.dequantize(), bnbf.dequantize_4bit(packed, state))
