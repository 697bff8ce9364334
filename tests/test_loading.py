"""Loading HF folders: both config.json forms, shards, dtypes, and a clear error for each user mistake."""
import copy
import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

import gapless
from gapless.model.loading import model_args_from_config, read_model_args, read_weight_headers

TINY = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16,
             "beta_slow": 0.25, "truncate": False},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_config_forms_4x_and_5x_give_the_same_model(hf_checkpoint, tmp_path, rope):
    import transformers

    _, folder = hf_checkpoint("llama", rope_parameters={**ROPES[rope], "rope_theta": 50000.0})
    assert "rope_parameters" in json.loads((folder / "config.json").read_text())  # the 5.x form
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    # the 4.x form: rope_theta at the top, rope_scaling null for plain RoPE, older files spell it "type"
    config["rope_scaling"] = None if kind == "default" else {"type" if kind == "linear" else "rope_type": kind,
                                                             **params}
    (old / "config.json").write_text(json.dumps(config))

    assert read_model_args(old) == read_model_args(folder)
    assert read_model_args(old).rope_theta == 50000.0 and read_model_args(old).rope_scaling.rope_type == kind
    with torch.no_grad():
        logits = gapless.load_model(old)(IDS)
        assert_close(logits, gapless.load_model(folder)(IDS), atol=0, rtol=0)
        # and transformers reads the 4.x file the same way
        assert_close(logits, transformers.AutoModelForCausalLM.from_pretrained(old)(IDS).logits, atol=1e-4, rtol=0)


def test_dynamic_rope_is_plain_rope_within_max_position_embeddings(hf_checkpoint):
    """transformers' dynamic NTK RoPE rescales its base only once a sequence grows past max_position_embeddings
    (64 here): below it, it is plain RoPE, which gapless runs, and refuses the longer sequences it would rescale."""
    import transformers

    from gapless.model.generate import generate_ids

    hf, folder = hf_checkpoint("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    ours = gapless.load_model(folder)
    assert ours.args.rope_scaling.rope_type == "dynamic"
    full = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for ids in (IDS, full[:, :64]):  # 16 positions, and all 64
            assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
        # the claim's boundary: past 64 positions transformers' base grows, and the logits part from plain RoPE's
        plain = transformers.AutoModelForCausalLM.from_pretrained(folder, rope_parameters={"rope_type": "default",
                                                                                          "rope_theta": 1e4})
        assert_close(plain(full[:, :64]).logits, hf(full[:, :64]).logits, atol=1e-4, rtol=0)
        assert not torch.allclose(plain(full).logits, hf(full).logits, atol=1e-2)
    with pytest.raises(ValueError, match=r"60 prompt tokens \+ 10 new ones pass the model's max_position_embeddings "
                                         r"64.*dynamic"):
        generate_ids(ours, list(range(60)), max_new_tokens=10)
    assert len(generate_ids(ours, list(range(60)), max_new_tokens=4).tokens) == 4


def test_sharded_checkpoint_and_dtypes(hf_checkpoint, tmp_path):
    hf, _ = hf_checkpoint("qwen2")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    ours = gapless.load_model(sharded)
    with torch.no_grad():
        ref = hf(IDS).logits
        assert_close(ours(IDS), ref, atol=1e-4, rtol=0)
        bf16 = gapless.load_model(sharded, dtype="bfloat16")
        assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
        assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32
        assert (bf16(IDS).float() - ref).abs().max() < 0.5  # bf16 keeps ~3 significant digits of logits ~6
    assert gapless.load_model(sharded, dtype=torch.float16).lm_head.weight.dtype == torch.float16
    assert gapless.load_model(sharded, dtype="auto").lm_head.weight.dtype == torch.float32  # config.json's dtype
    with pytest.raises(ValueError, match="'bfloat17' is not known; choose one of .*bfloat16"):
        gapless.load_model(sharded, dtype="bfloat17")


def test_tied_checkpoint_without_lm_head_and_old_inv_freq_keys(hf_checkpoint):
    hf, folder = hf_checkpoint("llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in read_weight_headers(folder)
    # some older conversions persisted RoPE buffers; transformers ignores them, so must we
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    ours = gapless.load_model(folder)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert not ours.training
    with torch.no_grad():
        assert_close(ours(IDS), hf(IDS).logits, atol=1e-4, rtol=0)


def test_missing_and_unexpected_keys_in_one_error(hf_checkpoint):
    _, folder = hf_checkpoint("llama")

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)
    _rewrite_weights(folder, edit)
    with pytest.raises(ValueError) as e:
        gapless.load_model(folder)
    msg = str(e.value)
    assert "missing keys: [model.layers.1.mlp.up_proj.weight]" in msg
    assert "unexpected keys: [model.layers.2.mlp.up_proj.weight]" in msg


@pytest.mark.parametrize("kind", ["missing", "unexpected"])
def test_one_missing_or_unexpected_tensor(hf_checkpoint, kind):
    _, folder = hf_checkpoint("qwen3", head_dim=24)
    key = "model.layers.0.self_attn.q_norm.weight"
    if kind == "missing":
        _rewrite_weights(folder, lambda t: t.pop(key))
    else:
        key = "model.layers.0.self_attn.q_norm.bias"
        _rewrite_weights(folder, lambda t: t.update({key: torch.zeros(24)}))
    with pytest.raises(ValueError, match=f"{kind} keys: \\[{key}\\]"):
        gapless.load_model(folder)


def test_shape_mismatch_names_key_and_shapes(hf_checkpoint):
    _, folder = hf_checkpoint("mistral")
    _edit_config(folder, intermediate_size=80)
    with pytest.raises(ValueError) as e:
        gapless.load_model(folder)
    assert ("model.layers.1.mlp.down_proj.weight has shape [64, 96] in model.safetensors, "
            "but config.json implies [64, 80]") in str(e.value)
    assert "model.layers.0.mlp.gate_proj.weight has shape [96, 64]" in str(e.value)


def test_pickle_only_folder_is_refused_and_never_unpickled(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    marker = tmp_path / "unpickled"

    class Payload:  # unpickling this creates `marker`
        def __reduce__(self):
            return (Path.touch, (marker,))
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*never unpickles.*safe_serialization=True"):
        gapless.load_model(folder)
    assert not marker.exists()


def test_missing_config_and_missing_weights(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: not found"):
        gapless.load_model(tmp_path)
    with pytest.raises(ValueError, match="not a folder"):
        gapless.load_model(tmp_path / "absent")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no model\.safetensors.*found model-00001-of-00002\.safetensors"):
        gapless.load_model(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, r"model_type: 'gpt2' is not supported; gapless supports llama, mistral, qwen2, qwen3"),
    ({"model_type": None}, r"model_type: None is not supported"),
    ({"hidden_size": "64"}, r"config\.json: hidden_size: expected a positive integer, got '64'"),
    ({"vocab_size": None}, r"vocab_size: required field is missing"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads: 3 does not divide num_attention_heads=4"),
    ({"hidden_act": "gelu"}, r"hidden_act: 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic"}}, r"rope_scaling\.factor: required field is missing"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": None},
     r"config\.json: max_position_embeddings: dynamic RoPE \(rope_scaling\) needs it"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope_parameters\.rope_type: 'longrope'"),
    ({"rope_scaling": {"type": "linear"}}, r"rope_scaling\.factor: required field is missing"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, r"rope_parameters\.low_freq_factor: required"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor: 0\.5: partial RoPE is not supported"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, r"quantization_config: quant_method .awq. checkpoints are not supported"),
])
def test_config_errors_name_the_file_and_field(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **change}))
    with pytest.raises(ValueError, match=message) as e:
        read_model_args(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_sliding_window_per_family():
    def windows(**config):
        return model_args_from_config({**TINY, **config}).sliding_window
    assert windows(sliding_window=4) == [None, None]  # llama has no window
    assert windows(model_type="mistral", sliding_window=4) == [4, 4]
    assert windows(model_type="mistral", sliding_window=None) == [None, None]
    assert windows(model_type="mistral") == [4096, 4096]  # MistralConfig's default when the key is absent
    assert windows(model_type="qwen2", sliding_window=4) == [None, None]  # use_sliding_window defaults to false
    assert windows(model_type="qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=1) == [None, 4]
    assert windows(model_type="qwen3", sliding_window=4, use_sliding_window=True,
                   layer_types=["sliding_attention", "full_attention"]) == [4, None]
    with pytest.raises(ValueError, match="layer_types: expected 2 entries"):
        windows(model_type="qwen3", use_sliding_window=True, layer_types=["sliding_attention"])


# --- the parallel load: the serial load's tensors bit for bit, its errors, its bounds


def _sharded(hf_checkpoint, tmp_path, **config) -> Path:
    """A tiny Llama saved in several shards with an index json (save_pretrained's own format)."""
    hf, _ = hf_checkpoint("llama", **config)
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*"))) > 2
    return folder


def _loaded_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()
            if not v.is_meta}


def _assert_bitwise_equal(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("dtype, tied", [("float32", False), ("bfloat16", True), ("float16", False)])
def test_parallel_load_equals_serial_bit_for_bit(hf_checkpoint, tmp_path, dtype, tied, monkeypatch):
    import gapless.model.loading as loading
    from gapless.model.loading import build, load_weights

    folder = _sharded(hf_checkpoint, tmp_path, tie_word_embeddings=tied)
    serial = load_weights(build(folder), dtype, threads=1)
    parallel = load_weights(build(folder), dtype, threads=4)
    _assert_bitwise_equal(_loaded_state(parallel), _loaded_state(serial))
    reads, read = [], loading._StagedReader.read
    monkeypatch.setattr(loading._StagedReader, "read", lambda self, *args: reads.append(args[2]) or read(self, *args))
    staged = load_weights(build(folder), dtype, threads=4, staged=True)  # the CUDA reader, run on the host
    _assert_bitwise_equal(_loaded_state(staged), _loaded_state(serial))
    assert len(reads) == len(serial.checkpoint_shapes)  # every tensor through the staged reader
    assert (parallel.lm_head.weight is parallel.model.embed_tokens.weight) == tied
    assert {p.dtype for p in parallel.parameters()} == {getattr(torch, dtype)}


def test_parallel_qlora_load_quantises_as_tensors_arrive(hf_checkpoint, tmp_path):
    from gapless.config import LoraConfig
    from gapless.model.loading import build, load_weights
    from gapless.model.method import Qlora

    folder = _sharded(hf_checkpoint, tmp_path)
    models = []
    for threads in (1, 4):
        method = Qlora(LoraConfig(r=4, alpha=8), torch.float32)
        model = method.transform(build(folder))
        models.append(load_weights(model, "float32", hook=method.load_hook, threads=threads))
    serial, parallel = map(_loaded_state, models)
    _assert_bitwise_equal(parallel, serial)
    assert "model.layers.1.mlp.down_proj.weight_packed" in parallel  # the NF4 storage, filled by the hook
    assert not any(k.endswith("proj.weight") for k in parallel)  # no bf16/fp32 base weight kept


def test_reads_are_bounded_in_threads_and_bytes(hf_checkpoint, tmp_path, monkeypatch):
    """At most `threads` reads ahead of the tensor being consumed, holding at most `inflight_bytes` (a tensor
    larger than that alone), on threads named gapless-load, no more of them than asked for."""
    import threading

    import gapless.model.loading as loading

    folder = _sharded(hf_checkpoint, tmp_path)
    model = loading.build(folder)
    largest = max(math.prod(s) for s in model.checkpoint_shapes.values()) * 4  # float32 bytes
    started: list[str] = []
    read = loading._read_tensor

    def counting(handle, file, key, device, dtype):
        started.append(key)
        return read(handle, file, key, device, dtype)

    monkeypatch.setattr(loading, "_read_tensor", counting)
    threads, budget = 3, largest + 4096
    consumed, most_ahead, most_threads = 0, 0, 0
    for key, tensor in loading.checkpoint_tensors(model, "cpu", torch.float32, threads, budget):
        consumed += 1
        most_ahead = max(most_ahead, len(started) - consumed)
        most_threads = max(most_threads, sum(t.name.startswith("gapless-load") for t in threading.enumerate()))
        assert tensor.shape == model.checkpoint_shapes[key]
    assert consumed == len(model.checkpoint_shapes) and sorted(started) == sorted(model.checkpoint_shapes)
    assert 0 < most_ahead <= threads - 1 and 0 < most_threads <= threads
    # a budget smaller than any tensor: one read at a time, none ahead
    started.clear()
    consumed, most_ahead = 0, 0
    for _ in loading.checkpoint_tensors(model, "cpu", torch.float32, threads, inflight_bytes=1):
        consumed += 1
        most_ahead = max(most_ahead, len(started) - consumed)
    assert most_ahead == 0


def test_a_corrupt_or_changed_shard_names_the_file_and_tensor(hf_checkpoint, tmp_path):
    from gapless.model.loading import build, load_weights

    folder = _sharded(hf_checkpoint, tmp_path)
    shards = sorted(folder.glob("model-*.safetensors"))
    shard = shards[1]
    tensors = load_file(shard)
    key = sorted(tensors)[0]
    # a tensor missing from a shard: the keys error, before anything is read
    save_file({k: v for k, v in tensors.items() if k != key}, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"missing keys: \[{key}\]"):
        build(folder)
    # the shard changed between the check and the read (another process rewrote the folder): the tensor named
    save_file(tensors, shard, metadata={"format": "pt"})
    model = build(folder)
    save_file({k: v for k, v in tensors.items() if k != key}, shard, metadata={"format": "pt"})
    for threads in (1, 4):
        with pytest.raises(ValueError, match=rf"{folder}: the checkpoint changed after it was checked; it no "
                                             rf"longer holds \[{key}\]"):
            load_weights(copy.deepcopy(model), "float32", threads=threads)
    # a truncated shard: named as not readable, at the check and at the read
    save_file(tensors, shard, metadata={"format": "pt"})
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{shard}: not a readable safetensors file"):
        build(folder)
    for threads in (1, 4):
        with pytest.raises(ValueError, match=rf"{shard}: not a readable safetensors file"):
            load_weights(copy.deepcopy(model), "float32", threads=threads)


def test_a_read_error_in_a_reading_thread_names_the_file_and_tensor(hf_checkpoint, tmp_path, monkeypatch):
    """An I/O error while a tensor's bytes are read (a failing disk) reaches the caller from the thread that met it,
    with the shard and the tensor named, and the reads not yet started are dropped."""
    import gapless.model.loading as loading

    folder = _sharded(hf_checkpoint, tmp_path)
    bad = "model.layers.1.mlp.up_proj.weight"
    opened = loading.safe_open

    class Failing:
        def __init__(self, *args, **kwargs):
            self.st = opened(*args, **kwargs)

        def __enter__(self):
            self.inner = self.st.__enter__()
            return self

        def __exit__(self, *exc):
            return self.st.__exit__(*exc)

        def __getattr__(self, name):  # keys, get_slice: the real handle's
            return getattr(self.inner, name)

        def get_tensor(self, key):
            if key == bad:
                raise OSError(5, "Input/output error")
            return self.inner.get_tensor(key)

    monkeypatch.setattr(loading, "safe_open", Failing)
    shard = read_weight_headers(folder)[bad][0]
    for threads in (1, 4):
        with pytest.raises(ValueError, match=rf"{shard}: tensor {bad} could not be read: .*Input/output error"):
            loading.load_weights(loading.build(folder), "float32", threads=threads)


def test_staged_reader_reads_every_dtype_in_chunks_and_names_a_short_file(tmp_path):
    """The CUDA loader's reader (pread into two staging buffers, then a copy to the device), run on the host with
    7-byte buffers so every tensor crosses several: each dtype it reinterprets, an empty tensor and a scalar come
    back equal to safetensors' own load; a file cut short after the check names the file and the tensor."""
    import os

    from gapless.model.loading import _STAGED_DTYPES, _StagedReader, tensor_extents

    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(5, 3, generator=g).bfloat16(), "f32": torch.randn(7, generator=g),
               "f16": torch.randn(2, 2, 3, generator=g).half(), "f64": torch.randn(3, generator=g).double(),
               "i64": torch.arange(-4, 5), "i32": torch.arange(9, dtype=torch.int32), "u8": torch.arange(11).byte(),
               "i8": torch.arange(-3, 3, dtype=torch.int8), "i16": torch.arange(5, dtype=torch.int16),
               "bool": torch.arange(6) % 2 == 0, "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    extents = tensor_extents(path)
    assert set(extents) == set(tensors) and {e[0] for e in extents.values()} <= set(_STAGED_DTYPES)
    reader = _StagedReader(torch.device("cpu"), stage_bytes=7)
    fd = os.open(path, os.O_RDONLY)
    try:
        for key, want in load_file(path).items():
            got = reader.read(fd, path, key, extents[key])
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key
    finally:
        os.close(fd)
    last = max(extents, key=lambda k: extents[k][3])
    path.write_bytes(path.read_bytes()[:extents[last][3] - 3])
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match=rf"{path}: tensor {last} could not be read: the file ends before byte"):
            reader.read(fd, path, last, extents[last])
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_staged_reader_state_survives_a_fork_from_another_thread(tmp_path):
    """A loading thread's staging state (on CUDA: pinned buffers and a stream) is not destroyed in a process forked
    from another thread while it loads: gapless train forks its tokenizer workers beside the load, and a CUDA
    object destroyed in the forked child aborts it. A threading.local's values are destroyed there (Python clears
    the other threads' states after a fork); the reader keeps them in a plain dict. Here a stand-in state that
    records where it is destroyed."""
    import os
    import threading

    from gapless.model.loading import _StagedReader

    marker = tmp_path / "destroyed"

    class Recorded:
        def __del__(self):
            with open(marker, "a") as f:
                f.write(f"{os.getpid()}\n")

    class Reader(_StagedReader):
        def _new_state(self):
            return [[Recorded(), None]], None

    reader, loading, release = Reader(torch.device("cpu")), threading.Event(), threading.Event()

    def load():
        reader._thread_state()
        loading.set()
        release.wait(timeout=60)

    thread = threading.Thread(target=load)
    thread.start()
    loading.wait(timeout=60)
    children = []

    def fork():  # as the data thread forks a worker: the child ends without running anything
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        children.append(pid)

    forker = threading.Thread(target=fork)
    forker.start()
    forker.join()
    release.set()
    thread.join()
    assert not marker.exists() or str(children[0]) not in marker.read_text().split()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage_bytes", [None, 4096])
def test_parallel_load_straight_to_cuda_equals_the_host_load(hf_checkpoint, tmp_path, monkeypatch, stage_bytes):
    """The staged CUDA reader (default buffers, and 4 KiB ones so each tensor takes many copies through the two
    buffers) gives the host load's tensors bit for bit."""
    import gapless.model.loading as loading
    from gapless.model.loading import build, load_weights

    if stage_bytes:
        monkeypatch.setattr(loading, "STAGE_BYTES", stage_bytes)
    folder = _sharded(hf_checkpoint, tmp_path)
    host = load_weights(build(folder), "bfloat16", "cpu", threads=1)
    cuda = load_weights(build(folder), "bfloat16", "cuda", threads=4)
    assert {p.device.type for p in cuda.parameters()} == {"cuda"}
    _assert_bitwise_equal({k: v.cpu() for k, v in _loaded_state(cuda).items()}, _loaded_state(host))


def test_a_peft_adapter_folder_given_as_the_model_names_its_base(hf_checkpoint, tmp_path):
    """An adapter folder (adapter_config.json, no config.json) is a common model.path mistake: the error names the
    base model to load instead (it advised copying config.json in, after which the weights were missing)."""
    from gapless.config import LoraConfig
    from gapless.model.lora import apply_lora, save_adapter

    _, folder = hf_checkpoint("llama")
    save_adapter(apply_lora(gapless.load_model(folder), LoraConfig(r=2, alpha=4)), tmp_path / "adapter",
                 base_model_name_or_path="meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match=r"adapter: a PEFT adapter \(adapter_config\.json\), not a model; load its base "
                                         r"model 'meta-llama/Llama-3.2-1B'"):
        gapless.load_model(tmp_path / "adapter")


def _save_hf(cls_name: str, folder: Path, **config) -> Path:
    """transformers' `cls_name` (a Llama class) of the tiny config, random, saved into `folder`."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(transformers.LlamaConfig(**{**TINY, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("cls_name", ["LlamaForSequenceClassification", "LlamaForTokenClassification",
                                      "LlamaForQuestionAnswering"])
def test_a_classifier_or_reward_checkpoint_is_named_as_not_a_causal_lm(tmp_path, cls_name):
    """A classifier's or reward model's head (score.weight, qa_outputs.weight) is not an LM head: said from
    config.json's architectures, not as 'missing keys: [lm_head.weight]; unexpected keys: [score.weight]'."""
    folder = _save_hf(cls_name, tmp_path / "clf", num_labels=1)
    message = (rf"config\.json: architectures: \['{cls_name}'\] is not a causal LM .*gapless fine-tunes causal "
               r"LMs \(\*ForCausalLM")
    with pytest.raises(ValueError, match=message):
        read_model_args(folder)  # before the weights: `gapless train` reads the config first
    with pytest.raises(ValueError, match=message):
        gapless.load_model(folder)


def test_a_base_decoder_saved_without_its_head(tmp_path):
    """LlamaModel's checkpoint (keys without `model.`, no lm_head) loads as transformers loads it into a
    ForCausalLM: with tied embeddings the head is the embedding; untied, transformers' head would be random, so it
    is an error that says so."""
    import transformers

    tied = _save_hf("LlamaModel", tmp_path / "tied", tie_word_embeddings=True)
    assert "model.embed_tokens.weight" not in read_weight_headers(tied)
    ours = gapless.load_model(tied)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    with torch.no_grad():
        assert_close(ours(IDS), transformers.AutoModelForCausalLM.from_pretrained(tied)(IDS).logits, atol=1e-4, rtol=0)
    untied = _save_hf("LlamaModel", tmp_path / "untied")
    with pytest.raises(ValueError, match=r"architectures: \['LlamaModel'\] is a base decoder without an LM head "
                                         r"\(lm_head\.weight\), and tie_word_embeddings is false"):
        read_model_args(untied)


def test_a_checkpoint_without_architectures_still_loads(hf_checkpoint):
    hf, folder = hf_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("architectures") == ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert_close(gapless.load_model(folder)(IDS), hf(IDS).logits, atol=1e-4, rtol=0)
