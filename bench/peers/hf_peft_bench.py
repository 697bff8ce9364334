"""Peer baseline: Hugging Face transformers + PEFT LoRA on a random-init Llama-3.2-3B (or --model-config's model).

Measures real (non-pad) tokens/s of forward+backward+AdamW steps under the
configurations the seed article discusses. One configuration per process.
Usage: python3 hf_peft_bench.py CONFIG [--lengths FILE] [--steps N] [--model-config DIR] [--dry-run]

gapless's copy of shared/peers/hf_peft_bench.py, with:
- the seed's own QLoRA stack (configs qlora_*): the random bf16 model saved to a folder, loaded back by
  from_pretrained with BitsAndBytesConfig (NF4, double quantisation, bf16 compute), prepare_model_for_kbit_training,
  then the same PEFT LoRA. Needs bitsandbytes.
- `--model-config DIR`: any architecture transformers' AutoModelForCausalLM builds from DIR/config.json (Llama,
  Gemma 2, Gemma 3 text, ...), random weights; Liger configurations apply liger_kernel.transformers'
  apply_liger_kernel_to_<model_type> for it (an error where liger-kernel has none).
- `--dry-run`: the same family shrunk to 2 layers of width 64 (a sliding and a global layer where it has both),
  documents of at most 64 tokens, one step on the CPU (CUDA for Liger, whose kernels are Triton): a check that the
  configuration builds and trains, not a measurement.
- `use_cache=False` in every forward. transformers 5.x (checked on 5.25) builds a DynamicCache when use_cache is on
  (the config's default) and then ignores the packed position_ids when it builds the mask (masking_utils
  `_preprocess_mask_arguments` looks for packed sequences only when there is no cache): the packed configurations
  became one causal 16,384-token document, each document attending to the ones before it (tiny float32 Llama /
  Gemma 3 / Gemma 2, weights std 0.2: logits 1.7 / 5.7 / 7.7 max abs away from each document run alone; with
  use_cache=False 6e-7 / 2.9e-6 / 3.4e-6). sdpa, eager and flex_attention alike. tests/test_hf_peer.py.
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
# --tiny / --dry-run: each size capped at these (an already smaller config keeps its own), 2 layers
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, sliding_window=16)
ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size")

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
    # the same with gradient checkpointing (what fits a model whose activations exceed the card)
    "packed_sdpa_ckpt": ("packed", 1, True, False),
    "packed_liger_ckpt": ("packed", 1, True, True),
    # the seed's QLoRA recipe (4-bit NF4 base, gradient checkpointing), packed and padded to the longest
    "qlora_packed_ckpt": ("packed", 1, True, False),
    "qlora_dyn_pad8_ckpt": ("dyn", 8, True, False),
}
PACK_TOKENS = int(os.environ.get("PACK_TOKENS", 16384))
MAX_SEQ = 4096  # every document capped here (gapless.bench.PEER_MAX_SEQ replays the same)


def make_config():
    from transformers import LlamaConfig
    try:
        cfg = LlamaConfig(**LLAMA32_3B, rope_parameters={"rope_theta": 500000.0, **ROPE})
    except TypeError:
        cfg = LlamaConfig(**LLAMA32_3B, rope_theta=500000.0, rope_scaling=ROPE)
    return cfg


def load_config(model_config):
    """The architecture to build: the seed's Llama-3.2-3B, or DIR/config.json read by transformers' AutoConfig
    (which also reads the transformers 4.x form of bench/models/*)."""
    if model_config is None:
        return make_config()
    from transformers import AutoConfig
    if not os.path.isfile(os.path.join(model_config, "config.json")):
        sys.exit(f"--model-config: no config.json in {model_config}")
    cfg = AutoConfig.from_pretrained(model_config)
    if hasattr(cfg, "text_config"):  # an image-text checkpoint: LoRA's q_proj/... would also hit the vision tower
        sys.exit(f"--model-config: {model_config} is a {cfg.model_type!r} image-text config; give its text "
                 f"config (model_type {cfg.text_config.model_type!r}) so the peer builds the text decoder only")
    return cfg


def shrink(cfg):
    """The same family at a CPU size (TINY), in place: a sliding and a global layer where the model has both."""
    for key, cap in TINY.items():
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, min(getattr(cfg, key), cap))
    if getattr(cfg, "query_pre_attn_scalar", None) is not None:  # Gemma: the score scale follows head_dim
        cfg.query_pre_attn_scalar = cfg.head_dim
    kinds = list(dict.fromkeys(getattr(cfg, "layer_types", None) or []))  # e.g. sliding_attention, full_attention
    cfg.num_hidden_layers = max(2, len(kinds))
    if kinds:
        cfg.layer_types = (kinds * 2)[:cfg.num_hidden_layers]
    return cfg


def apply_liger(model_type):
    """liger-kernel's patch of transformers' modeling code for this model type (before the model is built)."""
    import liger_kernel.transformers as lk
    name = f"apply_liger_kernel_to_{model_type}"
    if not hasattr(lk, name):
        sys.exit(f"liger-kernel has no {name}: no Liger configuration for model_type {model_type!r}")
    getattr(lk, name)()


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
        L.append(min(next(lens), MAX_SEQ))
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
        L = [MAX_SEQ] * mb
        T = MAX_SEQ
    else:
        L = [min(next(lens), MAX_SEQ) for _ in range(mb)]
        T = MAX_SEQ if mode == "pad_max" else int(math.ceil(max(L) / 8) * 8)
    ids = torch.randint(0, vocab, (mb, T), device=device)
    mask = torch.zeros(mb, T, dtype=torch.long, device=device)
    for i, l in enumerate(L):
        mask[i, :l] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels, sum(L), mb * T


def make_batch(mode, mb, lens, vocab, device):
    """(the model's inputs, real tokens, slots) of one step."""
    if mode == "packed":
        ids, pos, labels, r, s = packed_batch(lens, vocab, device)
        return dict(input_ids=ids, position_ids=pos, labels=labels), r, s
    ids, mask, labels, r, s = batch(mode, mb, lens, vocab, device)
    return dict(input_ids=ids, attention_mask=mask, labels=labels), r, s


def forward(model, inputs):
    """use_cache=False: with a cache, transformers 5.x ignores the packed position_ids and lets documents attend to
    each other (the docstring says more); a training step never needs the cache."""
    return model(**inputs, use_cache=False)


def attention_implementation(cfg, config_name):
    """ATTN, else flex for *_flex, else sdpa where transformers' class has it (Gemma 2 has not: its soft-capping
    needs the scores, so transformers runs it eager)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    if "ATTN" in os.environ:
        return os.environ["ATTN"]
    if config_name.endswith("_flex"):
        return "flex_attention"
    return "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]._supports_sdpa else "eager"


def build(cfg, config_name, ckpt, liger, dev):
    """transformers' model of cfg in bf16 with random weights, PEFT LoRA r16 on all seven projections."""
    from transformers import AutoModelForCausalLM
    from peft import LoraConfig, get_peft_model
    if liger:
        apply_liger(cfg.model_type)
    attn = attention_implementation(cfg, config_name)
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    torch.set_default_dtype(torch.float32)
    if config_name.startswith("qlora"):
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig
        folder = os.environ.get("QLORA_DIR", "/tmp/hf-peer-3b")
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": 0},
                                                     attn_implementation=attn,
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
    return model.train(), attn


def main():
    global PACK_TOKENS, MAX_SEQ
    ap = argparse.ArgumentParser()
    ap.add_argument("config", choices=sorted(CONFIGS))
    ap.add_argument("--lengths")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--model-config", metavar="DIR", help="build the architecture of DIR/config.json "
                    "(default: Llama-3.2-3B)")
    ap.add_argument("--tiny", action="store_true", help="smoke test with a tiny model on the CPU (Liger: the GPU)")
    ap.add_argument("--dry-run", action="store_true", help="the tiny model, 64-token documents, one step")
    a = ap.parse_args()
    mode, mb, ckpt, liger = CONFIGS[a.config]
    if a.dry_run:
        a.tiny, a.steps, a.warmup = True, 1, 0
        PACK_TOKENS, MAX_SEQ = 256, 64
    cfg = load_config(a.model_config)
    if a.tiny:
        shrink(cfg)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    # Liger's kernels are Triton: a tiny Liger run needs the GPU too
    dev = torch.device("cpu" if a.tiny and not liger else "cuda")
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.time()
    model, attn = build(cfg, a.config, ckpt, liger, dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=cuda)
    build_s = time.time() - t0
    lens = lengths_stream(a.lengths)
    vocab = cfg.vocab_size
    real = slots = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            sync()
            t = time.perf_counter()
            real = slots = 0
        inputs, r, s = make_batch(mode, mb, lens, vocab, dev)
        out = forward(model, inputs)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        real += r
        slots += s
    sync()
    dt = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    res = dict(config=a.config, real_tok_s=round(real / dt), slot_tok_s=round(slots / dt),
               pad_frac=round(1 - real / slots, 3), peak_gib=round(peak, 1),
               step_s=round(dt / a.steps, 3), build_s=round(build_s, 1), loss=round(out.loss.item(), 3),
               model_type=cfg.model_type, attn=attn, arch={k: getattr(cfg, k) for k in ARCH_FIELDS})
    print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
