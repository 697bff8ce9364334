"""Generation: the KV cache gives the logits of a full forward; greedy decoding is deterministic and equals
decoding without the cache (base, adapter, sliding window); sampling follows its seed; the CLI prints tokens/s."""
import io
import itertools
import json
import shutil

import pytest
import torch

from gapless import demo_task
from gapless.cli import main
from gapless.config import load_config
from gapless.demo import write_base_model
from gapless.model.generate import KVCache, encode_chat, generate_ids, load_for_generation, next_token, stop_ids
from gapless.model.loading import load_model
from gapless.train.loop import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """The demo's tiny Llama fine-tuned for 12 LoRA steps on its task: a run folder with adapter/."""
    root = tmp_path_factory.mktemp("generate")
    base = write_base_model(root / "base", seed=0)
    data = demo_task.write_jsonl(demo_task.make_examples(200, seed=1), root / "train.jsonl")
    cfg = load_config(data={
        "model": {"path": str(base), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(data)}], "max_seq_len": 64, "tokens_per_batch": 256,
                 "cache_dir": str(root / "cache"), "num_workers": 0},
        "lora": {"r": 8, "alpha": 16}, "optim": {"lr": 5e-3}, "train": {"steps": 12, "log_every": 6},
        "output_dir": str(root / "run"), "progress": False})
    train(cfg)
    return {"root": root, "base": base, "run": root / "run", "data": data}


def test_cache_gives_the_full_forward_logits(trained):
    model = load_model(trained["base"])
    torch.manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (1, 12))
    full = model(ids)
    cache = KVCache(len(model.model.layers))
    parts = [model.lm_head(model.hidden_states(ids[:, :7], position_ids=torch.arange(7)[None], cache=cache))]
    for t in range(7, 12):
        parts.append(model.lm_head(model.hidden_states(ids[:, t:t + 1], position_ids=torch.tensor([[t]]),
                                                       cache=cache)))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 12


@pytest.mark.parametrize("what", ["base", "run"])
def test_greedy_is_deterministic_and_equals_no_cache(trained, what):
    loaded = load_for_generation(trained[what], device="cpu")
    stop = stop_ids(loaded)
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": "shift: hello"}])
    runs = [generate_ids(loaded.model, prompt, max_new_tokens=16, stop=stop) for _ in range(2)]
    plain = generate_ids(loaded.model, prompt, max_new_tokens=16, stop=stop, use_cache=False)
    assert runs[0].tokens == runs[1].tokens == plain.tokens
    assert len(plain.tokens) >= 1


@pytest.mark.parametrize("family,config", [("mistral", {"sliding_window": 4}),
                                           ("gemma2", {"sliding_window": 4, "head_dim": 16})])
def test_sliding_window_cache_equals_no_cache(hf_checkpoint, family, config):
    """Mistral's window on every layer; Gemma 2's on alternate layers, with soft-capped scores and logits."""
    _, folder = hf_checkpoint(family, **config)
    model = load_model(folder)
    assert 4 in model.args.sliding_window
    prompt = list(range(3, 12))
    a = generate_ids(model, prompt, max_new_tokens=10)
    b = generate_ids(model, prompt, max_new_tokens=10, use_cache=False)
    assert a.tokens == b.tokens and len(a.tokens) == 10 and a.stopped == "length"


def test_sampling_follows_its_seed(trained):
    model = load_model(trained["base"])
    prompt = [1, 3, 10, 11, 12]
    a = generate_ids(model, prompt, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5)
    b = generate_ids(model, prompt, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5)
    assert a.tokens == b.tokens
    # a nucleus this small keeps only the most likely token: greedy
    assert generate_ids(model, prompt, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=1).tokens == \
        generate_ids(model, prompt, max_new_tokens=8).tokens


def test_top_p_keeps_the_smallest_prefix():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    seen = {int(next_token(logits, 1.0, 0.75, g)) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are cut
    assert int(next_token(logits, 0.0, 1.0, None)) == 0


def test_cli_generate_prints_reply_and_tokens_per_s(trained, capsys):
    assert main(["generate", str(trained["run"]), "--prompt", "shift: abcd", "--max-new-tokens", "8",
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "loaded adapter" in captured.err and "tokens/s" in captured.err
    assert len(captured.out.splitlines()) == 1


def test_cli_chat_keeps_the_conversation(trained, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("shift: abcd\nshift: wxyz\n/exit\n"))
    assert main(["chat", str(trained["run"]), "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("model> ") == 2


# what real adapter folders hold beside adapter_config.json: a training script's config
# (Adarsh5557/qwen7b-finetuned-Smart-MCQ-Solver's config.yaml) and an Unsloth user's config.json
# (DeveloperZeeshu/Nano_R1-model's, the base's fields and a "lora" section), both shortened
BESIDE_ADAPTER = {
    "config.yaml": 'model:\n  name: "Qwen/Qwen2.5-7B-Instruct"\n  save_path: "./checkpoints/first_mcq_lora_realval-1"\n'
                   "lora:\n  r: 16\n  alpha: 32\n  dropout: 0.05\nseed: 42\n",
    "config.json": json.dumps({"_name_or_path": "unsloth/qwen2.5-3b-instruct-unsloth-bnb-4bit",
                               "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 2048,
                               "unsloth_fixed": True, "lora": {"lora_alpha": 64, "lora_dropout": 0}}),
}


@pytest.mark.parametrize("beside", list(BESIDE_ADAPTER))
def test_an_adapter_folder_with_a_config_beside_is_the_adapter(trained, tmp_path, capsys, beside):
    """A PEFT adapter folder that also holds a config.yaml was read as a gapless run (its config refused), one with a
    config.json as a model folder (no weights); it is the adapter on its base_model_name_or_path, as transformers'
    from_pretrained reads it."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(trained["base"])
    reference = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        init_lora_weights=False)).eval()  # B random: not a no-op
    reference.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / beside).write_text(BESIDE_ADAPTER[beside])
    loaded = load_for_generation(tmp_path / "adapter", device="cpu")
    assert loaded.what.startswith(f"adapter {tmp_path / 'adapter'} on ")
    ids = torch.tensor([[1, 3, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), reference(ids).logits, atol=1e-4, rtol=0)
    assert main(["generate", str(tmp_path / "adapter"), "--prompt", "shift: abcd", "--max-new-tokens", "4",
                 "--device", "cpu"]) == 0
    assert "loaded adapter" in capsys.readouterr().err


def test_a_full_fine_tuning_run_generates_and_evaluates_with_its_model(trained, capsys):
    """A full fine-tuning run's final save is model/ (an HF folder), not adapter/: generate, chat and eval on the run
    folder load it (they said 'the run has no adapter/ yet')."""
    run = trained["root"] / "full"
    cfg = load_config(data={
        "model": {"path": str(trained["base"]), "dtype": "float32", "device": "cpu"}, "method": "full",
        "data": {"sources": [{"path": str(trained["data"])}], "max_seq_len": 64, "tokens_per_batch": 128,
                 "cache_dir": str(trained["root"] / "cache"), "num_workers": 0},
        "optim": {"lr": 1e-3}, "checkpoint": {"every": 0}, "train": {"steps": 2}, "output_dir": str(run),
        "progress": False})
    train(cfg)
    assert not (run / "adapter").exists()
    loaded = load_for_generation(run, device="cpu")
    assert loaded.what == f"model {run / 'model'}"
    final, base = load_model(run / "model"), load_model(trained["base"])
    for (name, a), b in zip(loaded.model.state_dict().items(), final.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(final.state_dict().values(), base.state_dict().values()))
    assert main(["generate", str(run), "--prompt", "shift: abcd", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert "loaded model" in capsys.readouterr().err
    assert main(["eval", str(run), "--data", str(trained["data"]), "--device", "cpu"]) == 0
    assert json.loads((run / "eval.json").read_text())[0]["model"] == f"model {run / 'model'}"


def test_a_qlora_run_generates_on_the_nf4_base_it_trained_on(trained, capsys):
    """A QLoRA run's adapter goes on the NF4 base it trained on, assembled as the run assembled it (on meta, quantised
    as the weights stream in): its logits are the adapter's on the quantised base (to_qlora, as `gapless export
    --merge` builds it), not on the unquantised one, which --unquantised-base gives instead, saying so. RUN/adapter
    named directly loads as its run."""
    from gapless.model.lora import load_adapter
    from gapless.model.qlora import QLoraLinear, to_qlora

    run = trained["root"] / "qlora"
    train(load_config(data={
        "model": {"path": str(trained["base"]), "dtype": "float32", "device": "cpu"}, "method": "qlora",
        "data": {"sources": [{"path": str(trained["data"])}], "max_seq_len": 64, "tokens_per_batch": 128,
                 "cache_dir": str(trained["root"] / "cache"), "num_workers": 0},
        "lora": {"r": 4, "alpha": 8}, "optim": {"lr": 1e-2}, "checkpoint": {"every": 0}, "train": {"steps": 4},
        "output_dir": str(run), "progress": False}))
    ids = torch.tensor([[1, 3, 10, 11, 12, 13, 14]])
    plain, _ = load_adapter(load_model(trained["base"]), run / "adapter")
    with torch.no_grad():
        unquantised = plain(ids)
        expected = to_qlora(plain, torch.float32)(ids)
    assert (unquantised - expected).abs().max() > 1e-3  # the base's quantisation shows, so the parity means something
    for source in (run, run / "adapter"):
        loaded = load_for_generation(source, device="cpu")
        assert sum(isinstance(m, QLoraLinear) for m in loaded.model.modules()) == 2 * 7
        assert loaded.what.endswith("as NF4, as the run trained it (float32 compute)"), loaded.what
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(ids), expected, atol=1e-5, rtol=0)
    loaded = load_for_generation(run, device="cpu", unquantised_base=True)
    assert not any(isinstance(m, QLoraLinear) for m in loaded.model.modules())
    assert "in float32, unquantised" in loaded.what
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), unquantised, atol=1e-5, rtol=0)

    for flags, said in (([], "as NF4"), (["--unquantised-base"], "in float32, unquantised")):
        assert main(["generate", str(run), "--prompt", "shift: abcd", "--max-new-tokens", "4", "--device", "cpu",
                     *flags]) == 0
        assert said in capsys.readouterr().err.splitlines()[0]
    with pytest.warns(UserWarning, match="--unquantised-base is ignored: .* is a lora run"):
        load_for_generation(trained["run"], device="cpu", unquantised_base=True)


@pytest.mark.parametrize("what", ["base", "run"])
def test_generation_config_eos_ids_stop_generation(trained, tmp_path, capsys, what):
    """generation_config.json's eos_token_id list (Qwen2.5 instruct's [151645, 151643], where config.json and the
    tokenizer name 151645 alone) stops generation at each of its ids: in a model folder, and in a run's adapter/
    (which holds a copy of its tokenizer folder's)."""
    source = tmp_path / what
    shutil.copytree(trained[what], source)
    loaded = load_for_generation(source, device="cpu")
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": "shift: hello"}])
    free = generate_ids(loaded.model, prompt, max_new_tokens=8)
    eos = loaded.tokenizer.eos_token_id  # </s>, config.json's eos_token_id too: the demo's one stop token
    head = list(itertools.takewhile(lambda t: t != eos, free.tokens))
    assert head, free.tokens  # its first token then stops generation earlier than eos did (here, or the cap of 8)
    second = head[0]
    (source / ("adapter" if what == "run" else "") / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [eos, second]}))

    assert main(["generate", str(source), "--prompt", "shift: hello", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    assert "; 1 new tokens, " in capsys.readouterr().err
    loaded = load_for_generation(source, device="cpu")
    assert loaded.generation_eos == sorted({eos, second}) and {eos, second} <= stop_ids(loaded)
    gen = generate_ids(loaded.model, prompt, max_new_tokens=8, stop=stop_ids(loaded))
    assert gen.tokens == [second] and gen.stopped == "end of turn"


@pytest.mark.parametrize("text,said", [
    ("{", "not valid JSON"),
    ("[2]", "the top level must be a JSON object, got list"),
    ('{"eos_token_id": "</s>"}', "eos_token_id: expected a token id or a list of token ids"),
    ('{"eos_token_id": [2, 3.0]}', "eos_token_id: expected a token id or a list of token ids"),
    ('{"eos_token_id": true}', "eos_token_id: expected a token id or a list of token ids")])
def test_a_malformed_generation_config_is_named_before_the_model_loads(trained, tmp_path, capsys, text, said):
    model = tmp_path / "model"
    shutil.copytree(trained["base"], model)
    (model / "generation_config.json").write_text(text)
    assert main(["generate", str(model), "--prompt", "shift: hello", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"gapless generate: error: {model / 'generation_config.json'}: {said}" in err, err
    assert "loaded" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_greedy_equals_no_cache(trained):
    loaded = load_for_generation(trained["run"], device="cuda", dtype="float32")
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": "shift: hello"}])
    a = generate_ids(loaded.model, prompt, max_new_tokens=16)
    b = generate_ids(loaded.model, prompt, max_new_tokens=16, use_cache=False)
    assert a.tokens == b.tokens
