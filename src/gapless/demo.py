"""`gapless demo`: a complete fine-tuning run on a CPU in about a minute, with no downloads.

It writes a tiny Llama-architecture model as a real HF folder (random weights), a character
tokenizer and a procedural task (gapless.demo_task), then fine-tunes it with LoRA through exactly
the code path of a real run: the messages reader, the chat template, assistant-only masking, the
token cache, packing, the training loop, checkpoints and the PEFT adapter export. It measures
exact-match accuracy on held-out examples before and after by greedy generation.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from gapless import demo_task
from gapless.config import load_config

# A 2-layer Llama (RoPE, GQA, SwiGLU, RMSNorm): 0.6M parameters.
DEMO_ARCH = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=384,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
    initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def write_base_model(folder: Path, seed: int) -> Path:
    """A random-init tiny Llama saved as an HF folder (config.json + model.safetensors + tokenizer)."""
    from gapless.model.decoder import CausalLM
    from gapless.model.export import save_pretrained
    from gapless.model.loading import model_args_from_config

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(DEMO_ARCH, vocab_size=demo_task.vocab_size())
    torch.manual_seed(seed)
    model = CausalLM(model_args_from_config(config))
    with torch.no_grad():  # transformers' LlamaPreTrainedModel init: N(0, initializer_range), norms at 1 ...
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, config["initializer_range"])
        # ... except the frozen LM head: at std 0.02 its logits span only about +-0.5 (|h| ~ sqrt(128)),
        # which no adapter upstream of it can widen; at 1/sqrt(hidden) they start ~N(0, 1), as in a trained model
        model.lm_head.weight.normal_(0.0, config["hidden_size"] ** -0.5)
    model.config_dict = config
    tokenizer_dir = demo_task.write_tokenizer(folder / "tokenizer")
    save_pretrained(model, folder, source_dir=tokenizer_dir)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 10) -> list[str]:
    """Greedy decoding, batched by prompt length (no padding needed), stopping at the end-of-turn token."""
    model.eval()
    eos = tokenizer.eos_token_id
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in prompts]
    answers: list[str] = [""] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([encoded[i] for i in idx])
        done = torch.zeros(len(idx), dtype=torch.bool)
        out = []
        for _ in range(max_new_tokens):
            nxt = model(ids)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            out.append(nxt)
            done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if done.all():
                break
        gen = torch.stack(out, dim=1).tolist()
        for row, i in zip(gen, idx):
            row = row[:row.index(eos)] if eos in row else row
            answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    return answers


def accuracy(model, tokenizer, examples: list[dict]) -> tuple[float, list[tuple[str, str, str]]]:
    prompts = [ex["messages"][0]["content"] for ex in examples]
    wanted = [ex["messages"][1]["content"] for ex in examples]
    got = greedy_answers(model, tokenizer, prompts)
    right = sum(g == w for g, w in zip(got, wanted))
    return right / len(examples), list(zip(prompts, wanted, got))


def run_demo(out_dir: str | Path = "runs/demo", steps: int = 400, seed: int = 0, stream=None,
             threads: int | None = 1) -> dict:
    """The demo with torch's intra-op threads set to `threads` (None: leave them) and restored after.

    One thread, because the model's matmuls are too small for threads to pay much (about 8k real
    tokens/s on one, at best 10k seen on two), while every parallel op waits for its slowest thread:
    on 2 cores shared with other work (load 3-5), 100 demo steps took 180-200 s with 2 threads and
    13-20 s with 1.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        return _run_demo(Path(out_dir), steps, seed, stream)
    finally:
        torch.set_num_threads(previous)


def _run_demo(out: Path, steps: int, seed: int, stream) -> dict:
    from transformers import AutoTokenizer

    from gapless.model.loading import load_model
    from gapless.model.lora import load_adapter
    from gapless.train.loop import train

    stream = stream or sys.stdout
    say = lambda text: print(text, file=stream, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    base = write_base_model(out / "base", seed)
    train_file = demo_task.write_jsonl(demo_task.make_examples(6000, seed=seed + 1), out / "data" / "train.jsonl")
    held_out = demo_task.make_examples(200, seed=seed + 2)
    eval_file = demo_task.write_jsonl(held_out[:100], out / "data" / "eval.jsonl")
    test = held_out[100:]
    tokenizer = AutoTokenizer.from_pretrained(str(base), trust_remote_code=False)
    say(f"demo: task 'shift each letter by one' (e.g. {test[0]['messages'][0]['content']!r} -> "
        f"{test[0]['messages'][1]['content']!r}); tiny Llama in {base}")

    model = load_model(base)
    acc_before, _ = accuracy(model, tokenizer, test)
    say(f"before fine-tuning: exact match {acc_before:.0%} on {len(test)} held-out words")

    cfg = load_config(data={
        "model": {"path": str(base), "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(train_file), "format": "messages"}],
                 "eval_sources": [{"path": str(eval_file), "format": "messages"}],
                 "max_seq_len": 64, "tokens_per_batch": 1024, "batching": "packed",
                 "cache_dir": str(out / "cache"), "num_workers": 0},
        "lora": {"r": 16, "alpha": 32},
        "optim": {"lr": 5e-3, "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1},
        "checkpoint": {"every": 100, "keep": 2},
        "train": {"steps": steps, "log_every": 25, "eval_every": 100, "seed": seed},
        "output_dir": str(out / "run"),
    })
    result = train(cfg, out=stream)

    tuned, _ = load_adapter(load_model(base), result.final_dir)  # the exported PEFT adapter, as a user loads it
    acc_after, samples = accuracy(tuned, tokenizer, test)
    say(f"after fine-tuning:  exact match {acc_after:.0%} on the same {len(test)} held-out words")
    for prompt, want, got in samples[:5]:
        say(f"  {prompt!r:>18} -> {got!r:10} (expected {want!r}){'' if got == want else '  x'}")
    summary = {"accuracy_before": acc_before, "accuracy_after": acc_after, "steps": result.steps,
               "tokens_per_s": result.steady_tokens_per_s, "run_dir": str(result.run_dir),
               "adapter": str(result.final_dir), "base_model": str(base), "seconds": time.perf_counter() - t0}
    say(f"training throughput: {summary['tokens_per_s']:,.0f} real tokens/s after the first step (CPU, fp32)")
    say(f"run folder: {result.run_dir} (config.yaml, metrics.jsonl, checkpoints/, adapter/); "
        f"total {summary['seconds']:.0f} s")
    return summary
