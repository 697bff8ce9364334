"""Peer baseline: Hugging Face transformers + PEFT LoRA on a random-init Llama-3.2-3B.

Measures real (non-pad) tokens/s of forward+backward+AdamW steps under the
configurations the seed article discusses. One configuration per process.
Usage: python3 hf_peft_bench.py CONFIG [--lengths FILE] [--steps N]

gapless's copy of shared/peers/hf_peft_bench.py, with the seed's own QLoRA stack added (configs qlora_*): the
random bf16 model saved to a folder, loaded back by from_pretrained with BitsAndBytesConfig (NF4, double
quantisation, bf16 compute), prepare_model_for_kbit_training, then the same PEFT LoRA. Needs bitsandbytes.
"""
import argparse, json, math, os, random, sys, time

import torch

LLAMA32_3B = dict(
    hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
    num_attention_heads=24, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=True, hidden_act="silu", bos_token_id=128000,
    eos_token_id=128001,
)
ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

CONFIGS = {
    # name: (mode, micro_batch, grad_ckpt, liger)
    "ideal_fixed4096": ("fixed", 4, False, False),
    "pad_max4096_ckpt": ("pad_max", 4, True, False),
    "dyn_pad_ckpt": ("dyn", 16, True, False),
    "dyn_pad": ("dyn", 16, False, False),
    "dyn_pad8": ("dyn", 8, False, False),
    "dyn_pad_liger": ("dyn", 16, False, True),
    "ideal_fixed4096_liger": ("fixed", 4, False, True),
    # padding-free packing: one row of 16384 tokens, position_ids restart per document
    "packed_sdpa": ("packed", 1, False, False),
    "packed_flex": ("packed", 1, False, False),
    "packed_liger": ("packed", 1, False, True),
    # the seed's QLoRA recipe (4-bit NF4 base, gradient checkpointing), packed and padded to the longest
    "qlora_packed_ckpt": ("packed", 1, True, False),
    "qlora_dyn_pad8_ckpt": ("dyn", 8, True, False),
}
PACK_TOKENS = int(os.environ.get("PACK_TOKENS", 16384))


def make_config():
    from transformers import LlamaConfig
    try:
        cfg = LlamaConfig(**LLAMA32_3B, rope_parameters={"rope_theta": 500000.0, **ROPE})
    except TypeError:
        cfg = LlamaConfig(**LLAMA32_3B, rope_theta=500000.0, rope_scaling=ROPE)
    cfg._attn_implementation = os.environ.get("ATTN", "sdpa")
    return cfg


def lengths_stream(path, seed=0):
    rng = random.Random(seed)
    if path:
        lens = [int(x) for x in open(path).read().split()]
    else:  # stand-in: log-normal, median ~350 tokens
        lens = [max(16, min(4096, int(math.exp(rng.gauss(math.log(350), 0.9))))) for _ in range(20000)]
    while True:
        rng.shuffle(lens)
        yield from lens


def packed_batch(lens, vocab, device):
    L = []
    while sum(L) < PACK_TOKENS:
        L.append(min(next(lens), 4096))
    L[-1] -= sum(L) - PACK_TOKENS
    if L[-1] == 0:
        L.pop()
    ids = torch.randint(0, vocab, (1, PACK_TOKENS), device=device)
    pos = torch.cat([torch.arange(l, device=device) for l in L]).unsqueeze(0)
    labels = ids.clone()
    labels[pos == 0] = -100  # no prediction across a document boundary
    return ids, pos, labels, PACK_TOKENS, PACK_TOKENS


def batch(mode, mb, lens, vocab, device):
    if mode == "fixed":
        L = [4096] * mb
        T = 4096
    else:
        L = [min(next(lens), 4096) for _ in range(mb)]
        T = 4096 if mode == "pad_max" else int(math.ceil(max(L) / 8) * 8)
    ids = torch.randint(0, vocab, (mb, T), device=device)
    mask = torch.zeros(mb, T, dtype=torch.long, device=device)
    for i, l in enumerate(L):
        mask[i, :l] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels, sum(L), mb * T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--lengths")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    a = ap.parse_args()
    if a.tiny:
        LLAMA32_3B.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512)
    mode, mb, ckpt, liger = CONFIGS[a.config]
    if a.config.endswith("_flex"):
        os.environ["ATTN"] = "flex_attention"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cpu" if a.tiny else "cuda")
    if a.tiny:
        torch.cuda.synchronize = lambda: None
        torch.cuda.reset_peak_memory_stats = lambda: None
        torch.cuda.max_memory_allocated = lambda: 0
    t0 = time.time()
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    from transformers import LlamaForCausalLM
    from peft import LoraConfig, get_peft_model
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = LlamaForCausalLM(make_config())
    torch.set_default_dtype(torch.float32)
    if a.config.startswith("qlora"):
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig
        folder = os.environ.get("QLORA_DIR", "/tmp/hf-peer-3b")
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": 0},
                                                 quantization_config=BitsAndBytesConfig(
                                                     load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                     bnb_4bit_use_double_quant=True,
                                                     bnb_4bit_compute_dtype=torch.bfloat16))
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=not a.tiny)
    build_s = time.time() - t0
    lens = lengths_stream(a.lengths)
    vocab = LLAMA32_3B["vocab_size"]
    real = slots = 0
    torch.cuda.reset_peak_memory_stats()
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            torch.cuda.synchronize()
            t = time.perf_counter()
            real = slots = 0
        if mode == "packed":
            ids, pos, labels, r, s = packed_batch(lens, vocab, dev)
            out = model(input_ids=ids, position_ids=pos, labels=labels)
        else:
            ids, mask, labels, r, s = batch(mode, mb, lens, vocab, dev)
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        real += r
        slots += s
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    res = dict(config=a.config, real_tok_s=round(real / dt), slot_tok_s=round(slots / dt),
               pad_frac=round(1 - real / slots, 3), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
               step_s=round(dt / a.steps, 3), build_s=round(build_s, 1), loss=round(out.loss.item(), 3))
    print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
