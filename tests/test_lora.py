"""LoRA against PEFT both ways, and the merged folder against transformers."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.testing import assert_close

import gapless
from gapless.config import ALL_LINEAR, LoraConfig
from gapless.model.lora import LoraLinear, apply_lora, load_adapter, lora_state_dict, merge_lora, save_adapter
from gapless.model.export import save_pretrained

TOL = dict(atol=1e-4, rtol=0)
IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))


def _train(forward, params, steps=4, seed=0):
    """A few SGD steps on random next-token data, so lora_B moves off zero."""
    opt = torch.optim.SGD(params, lr=0.2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids, targets = torch.randint(0, 96, (2, 2, 10), generator=g)
        loss = F.cross_entropy(forward(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def test_apply_lora_initialises_and_freezes_like_peft(hf_checkpoint):
    import peft

    hf, folder = hf_checkpoint("qwen2")
    ours = gapless.load_model(folder)
    base = _logits(ours)
    apply_lora(ours, LoraConfig(r=4, alpha=8))
    assert len([m for m in ours.modules() if isinstance(m, LoraLinear)]) == 2 * 7
    q = ours.model.layers[0].self_attn.q_proj
    assert q.bias is not None and "model.layers.0.self_attn.q_proj.bias" in ours.state_dict()
    assert torch.all(q.lora_B.weight == 0)
    bound = 1 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on fan_in 64
    assert q.lora_A.weight.abs().max() <= bound and q.lora_A.weight.abs().max() > bound / 2
    assert_close(_logits(ours), base, atol=0, rtol=0)  # B = 0: the adapted model starts as the base
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in trainable)
    reference = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR)))
    assert sum(p.numel() for n, p in ours.named_parameters() if n in trainable) == \
        reference.get_nb_trainable_parameters()[0]
    assert {"base_model.model." + n for n in trainable} == {n.replace(".default", "") for n, p in
                                                             reference.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model_type, config, cfg", [
    ("llama", {"tie_word_embeddings": True}, LoraConfig(r=4, alpha=8)),
    ("qwen2", {}, LoraConfig(r=8, alpha=16, dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"],
                             use_rslora=True)),
])
def test_our_adapter_loads_in_peft(hf_checkpoint, tmp_path, model_type, config, cfg):
    import peft

    hf, folder = hf_checkpoint(model_type, **config)
    ours = apply_lora(gapless.load_model(folder), cfg).train()
    base = _logits(hf)
    _train(ours, [p for p in ours.parameters() if p.requires_grad])
    ours.eval()
    assert ours.model.layers[1].self_attn.v_proj.lora_B.weight.abs().max() > 1e-3
    adapted = _logits(ours)
    assert (adapted - base).abs().max() > 1e-2  # the adapter changes the output, so parity below means something

    save_adapter(ours, tmp_path / "adapter", cfg, base_model_name_or_path=str(folder))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(folder) and written["use_rslora"] == cfg.use_rslora
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as st:
        assert set(st.keys()) == set(lora_state_dict(ours))
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert_close(_logits(reference), adapted, **TOL)


@pytest.mark.parametrize("model_type, config, targets, rslora", [
    ("qwen3", {"head_dim": 24}, "all-linear", False),
    ("mistral", {"sliding_window": 5}, ["k_proj", "o_proj", "gate_proj", "up_proj"], True),
])
def test_peft_adapter_loads_in_gapless(hf_checkpoint, tmp_path, model_type, config, targets, rslora):
    import peft

    hf, folder = hf_checkpoint(model_type, **config)
    reference = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.05, target_modules=targets,
                                                        use_rslora=rslora, task_type="CAUSAL_LM")).train()
    _train(lambda ids: reference(ids).logits, [p for p in reference.parameters() if p.requires_grad])
    reference.eval().save_pretrained(tmp_path / "adapter")
    expected = _logits(reference)

    ours = gapless.load_model(folder)
    assert (_logits(ours) - expected).abs().max() > 1e-2
    ours, cfg = load_adapter(ours, tmp_path / "adapter")
    assert (cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora) == (4, 12.0, 0.05, rslora)
    assert cfg.target_modules == (list(ALL_LINEAR) if targets == "all-linear" else
                                  [t for t in ALL_LINEAR if t in targets])
    assert_close(_logits(ours.eval()), expected, **TOL)


def test_peft_adapter_with_a_regex_target_loads_in_gapless(hf_checkpoint, tmp_path):
    """A string target_modules is a regular expression PEFT fullmatches to module names."""
    import peft

    hf, folder = hf_checkpoint("llama")
    reference = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.(v_proj|up_proj)"))
    _train(lambda ids: reference(ids).logits, [p for p in reference.parameters() if p.requires_grad])
    reference.eval().save_pretrained(tmp_path / "adapter")
    ours, cfg = load_adapter(gapless.load_model(folder), tmp_path / "adapter")
    assert cfg.target_modules == ["v_proj", "up_proj"]
    assert_close(_logits(ours.eval()), _logits(reference), **TOL)


@pytest.mark.parametrize("options, targets", [
    # orthogonal and EVA initialisation choose A's and B's starting values only: the adapter is plain LoRA on the
    # unchanged base (gapless refused them with PiSSA's kind, which rewrites the base)
    ({"init_lora_weights": "orthogonal"}, ["q_proj", "v_proj"]),
    # peft 0.22's NoRA and MiCA (peft/tuners/lora/layer.py nora_init, mica_init) leave the base unchanged too
    ({"init_lora_weights": "nora"}, ["q_proj", "v_proj"]),
    ({"init_lora_weights": "mica"}, ["q_proj", "v_proj"]),
    ({"init_lora_weights": "eva", "target_modules": ["q_proj", "v_proj", "o_proj"], "exclude_modules": ["o_proj"]},
     ["q_proj", "v_proj"]),
    ({"target_modules": "all-linear", "exclude_modules": r".*\.mlp\..*"}, ["q_proj", "k_proj", "v_proj", "o_proj"]),
])
def test_peft_adapter_with_a_plain_init_or_exclude_modules_loads_in_gapless(hf_checkpoint, tmp_path, options, targets):
    import peft

    hf, folder = hf_checkpoint("llama")
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **options}
    init = settings.pop("init_lora_weights", True)
    reference = peft.get_peft_model(hf, peft.LoraConfig(**settings, init_lora_weights=init if init != "eva" else True))
    _train(lambda ids: reference(ids).logits, [p for p in reference.parameters() if p.requires_grad])
    reference.eval().save_pretrained(tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # EVA needs activations to initialise; its saved adapter differs from a plain one by this field only
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**written, "init_lora_weights": init}))
    ours, cfg = load_adapter(gapless.load_model(folder), tmp_path / "adapter")
    assert cfg.target_modules == targets
    assert_close(_logits(ours.eval()), _logits(reference), **TOL)


def test_exclude_modules_leaving_some_layers_is_refused(hf_checkpoint, tmp_path):
    _, folder = hf_checkpoint("llama")
    save_adapter(apply_lora(gapless.load_model(folder), LoraConfig(r=2, alpha=4)), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {**config, "exclude_modules": ["model.layers.1.mlp.down_proj"]}))
    with pytest.raises(ValueError, match=r"adapts some layers but not \['model\.layers\.1\.mlp\.down_proj'\]"):
        load_adapter(gapless.load_model(folder), tmp_path / "adapter")


@pytest.mark.parametrize("model_type, config", [("llama", {"tie_word_embeddings": True}), ("qwen2", {})])
def test_merged_folder_loads_in_transformers(hf_checkpoint, tmp_path, model_type, config):
    import transformers

    _, folder = hf_checkpoint(model_type, **config)
    (folder / "tokenizer.json").write_text('{"model": "a tokenizer file to copy"}')
    ours = apply_lora(gapless.load_model(folder), LoraConfig(r=4, alpha=8)).train()
    _train(ours, [p for p in ours.parameters() if p.requires_grad])
    adapted = _logits(ours.eval())

    with pytest.raises(ValueError, match="merge_lora"):
        save_pretrained(ours, tmp_path / "merged")
    merge_lora(ours)
    assert not any(isinstance(m, LoraLinear) for m in ours.modules())
    assert not any("lora" in k for k in ours.state_dict())
    assert_close(_logits(ours), adapted, **TOL)

    out = save_pretrained(ours, tmp_path / "merged", max_shard_bytes=60_000)  # small shards: exercise the index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ("lm_head.weight" in index["weight_map"]) != config.get("tie_word_embeddings", False)
    assert (out / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    assert (out / "generation_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"

    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert_close(reloaded(IDS).logits, adapted, **TOL)
    assert_close(_logits(gapless.load_model(out)), adapted, **TOL)


@pytest.mark.parametrize("change, refused", [
    ({"use_dora": True}, "use_dora=True"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\]"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern="),
    ({"layers_to_transform": [0]}, r"layers_to_transform=\[0\]"),
    # an int is one layer's index (peft's check_target_module_exists); 0 passed as unset, silently
    ({"layers_to_transform": 0}, "layers_to_transform=0"),
    ({"bias": "all"}, "bias='all'"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
    ({"an_option_from_a_later_peft": 1}, "an_option_from_a_later_peft=1"),
    ({"target_modules": r"model\.layers\.0\..*q_proj"}, "adapts some layers but not"),  # a regex, as PEFT fullmatches
    ({"target_modules": r".*(q_proj|embed_tokens)"}, r"target_modules: \['model\.embed_tokens'\] not supported"),
    ({"target_modules": "(q_proj"}, "not a valid regular expression"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules: \['lm_head'\] not supported"),
    ({"target_modules": ["model.layers.0.self_attn.q_proj"]}, "adapts some layers but not"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
])
def test_load_adapter_refuses_what_it_does_not_implement(hf_checkpoint, tmp_path, change, refused):
    _, folder = hf_checkpoint("llama")
    save_adapter(apply_lora(gapless.load_model(folder), LoraConfig(r=2, alpha=4)), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=r"adapter_config\.json: .*" + refused):
        load_adapter(gapless.load_model(folder), tmp_path / "adapter")


def test_adapter_and_lora_errors(hf_checkpoint, tmp_path):
    _, folder = hf_checkpoint("llama")
    ours = apply_lora(gapless.load_model(folder), LoraConfig(r=2, alpha=4, target_modules=["q_proj"]))
    assert json.loads((save_adapter(ours, tmp_path / "a") / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(folder.resolve())  # defaults to the folder the base came from
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(ours, LoraConfig())
    with pytest.raises(ValueError, match=r"lora\.r: must be a positive integer"):
        apply_lora(gapless.load_model(folder), LoraConfig(r=0))

    # the weights must match the config: this adapter holds q_proj only
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj"]}))
    with pytest.raises(ValueError, match=r"missing keys: \['base_model\.model\.model\.layers\.0\.self_attn\.v_proj"):
        load_adapter(gapless.load_model(folder), tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "r": 3}))
    with pytest.raises(ValueError, match=r"lora_A\.weight has shape \[2, 64\], but the model and r=3 imply \[3, 64\]"):
        load_adapter(gapless.load_model(folder), tmp_path / "a")

    # a pickled adapter is refused, never unpickled
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "a" / "adapter_model.safetensors").rename(tmp_path / "a" / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin is a pickle.*safe_serialization=True"):
        load_adapter(gapless.load_model(folder), tmp_path / "a")
