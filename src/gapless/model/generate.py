"""Text generation for trying a model: the base, a run's adapter on it, or a merged folder (`gapless generate`,
`gapless chat`).

Decoding runs one sequence with a KV cache: the prompt's keys and values are computed once (the prefill), then
each new token attends to the cached ones, so a token costs one position's forward instead of the whole sequence
so far. Greedy decoding (temperature 0) is deterministic and equals decoding without the cache
(tests/test_generate.py); sampling applies temperature, then top-p (nucleus) truncation. Each new token is read on
the host (one sync per token) to stop at the end of the turn.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from gapless.model.decoder import softcap as softcap_fn

# end-of-turn tokens of the common chat templates, stopped at when the tokenizer has them (Llama 3, ChatML/Qwen,
# Gemma); the tokenizer's eos, config.json's and generation_config.json's eos_token_id(s) are stop tokens as well
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
GENERATION_CONFIG = "generation_config.json"


class KVCache:
    """Keys and values of the positions decoded so far, one [B, T, Hkv, head_dim] pair per layer.

    `attend` is what a decoder Attention calls instead of its attention backend when given a cache: the new
    positions' keys and values are appended, and the new queries attend causally to everything cached (plain
    scaled_dot_product_attention, the sdpa reference's maths with the query offset by the cached length)."""

    def __init__(self, num_layers: int):
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[1]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sliding_window: int | None,
               scale: float, softcap: float | None = None) -> Tensor:
        past = 0 if self.keys[layer] is None else self.keys[layer].shape[1]
        if past:
            k = torch.cat([self.keys[layer], k], dim=1)
            v = torch.cat([self.values[layer], v], dim=1)
        self.keys[layer], self.values[layer] = k, v
        Tq, Tk, Hq = q.shape[1], k.shape[1], q.shape[2]
        if k.shape[2] != Hq:  # GQA: each KV head serves Hq // Hkv query heads
            k = k.repeat_interleave(Hq // k.shape[2], dim=2)
            v = v.repeat_interleave(Hq // v.shape[2], dim=2)
        i = past + torch.arange(Tq, device=q.device)  # the queries' absolute positions
        j = torch.arange(Tk, device=q.device)
        allowed = j[None, :] <= i[:, None]  # [Tq, Tk]
        if sliding_window is not None:
            allowed = allowed & (i[:, None] - j[None, :] < sliding_window)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        if softcap is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed[None, None], scale=scale)
        else:  # Gemma 2: scores -> cap * tanh(scores / cap) before the mask and softmax, as the sdpa reference does
            scores = softcap_fn(qt.float() @ kt.float().transpose(-1, -2) * scale, softcap)  # [B, H, Tq, Tk]
            probs = scores.masked_fill(~allowed[None, None], float("-inf")).softmax(-1)
            out = (probs @ vt.float()).to(q.dtype)
        return out.transpose(1, 2)  # [B, Tq, Hq, D]


def next_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    """logits [vocab] (float32) -> the next token id: argmax at temperature 0, else a nucleus sample."""
    if temperature <= 0:
        return logits.argmax()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return order[torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)][0]
    return torch.multinomial(probs, 1, generator=generator)[0]


@dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)  # the new tokens, the stop token included
    stopped: str = "length"  # "end of turn" or "length" (max_new_tokens reached)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens after the first over the decoding time (the first comes from the prefill)."""
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0


@torch.no_grad()
def generate_ids(model, prompt: list[int], *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, stop: set[int] | frozenset[int] = frozenset(), use_cache: bool = True,
                 seed: int | None = None) -> Generation:
    """Decode up to `max_new_tokens` after `prompt`, stopping after a token in `stop`."""
    if not prompt:
        raise ValueError("the prompt is empty: nothing to continue from")
    if not temperature >= 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 (0 = greedy) and top_p in (0, 1]; got {temperature}, {top_p}")
    limit = model.args.max_position_embeddings
    if model.args.rope_scaling.rope_type == "dynamic" and len(prompt) + max_new_tokens > limit:
        # past it transformers rescales a dynamic NTK RoPE, gapless does not (gapless.model.decoder.rope_frequencies)
        raise ValueError(f"{len(prompt)} prompt tokens + {max_new_tokens} new ones pass the model's "
                         f"max_position_embeddings {limit}, past which its rope_type 'dynamic' RoPE would be "
                         "rescaled, which gapless does not implement; shorten the prompt or max_new_tokens")
    model.eval()
    device = next(model.parameters()).device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    out = Generation(prompt_tokens=len(prompt))
    cache = KVCache(len(model.model.layers)) if use_cache else None
    ids = torch.tensor([prompt], device=device)  # [1, T]
    t0 = time.perf_counter()
    for n in range(max_new_tokens):
        if cache is None:
            hidden = model.hidden_states(ids)
        else:
            fresh = ids if n == 0 else ids[:, -1:]  # the prefill, then one new position per step
            positions = torch.arange(cache.length, cache.length + fresh.shape[1], device=device)[None]
            hidden = model.hidden_states(fresh, position_ids=positions, cache=cache)
        logits = softcap_fn(model.lm_head(hidden[0, -1]), model.args.final_softcap)  # as forward() gives them
        token = next_token(logits.float(), temperature, top_p, generator)
        tok = int(token)  # SYNC: one per token, to stop at the end of the turn
        if n == 0:
            out.prefill_s = time.perf_counter() - t0
        out.tokens.append(tok)
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
        if tok in stop:
            out.stopped = "end of turn"
            break
    out.decode_s = time.perf_counter() - t0 - out.prefill_s
    return out


# ---------------------------------------------------------------------------------------------
# what to load: a model folder (base or merged), an adapter folder, or a run folder


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    what: str  # "base model FOLDER", "adapter ADAPTER on BASE", ...
    generation_eos: list[int] = field(default_factory=list)  # the folders' generation_config.json eos_token_id(s)


def load_for_generation(source: str | Path, *, device: str = "auto", dtype: str | None = None,
                        base: str | Path | None = None, unquantised_base: bool = False) -> Loaded:
    """`source`: an HF model folder (a base or a merged model), a PEFT adapter folder (on `base`, or on the base
    its adapter_config.json names), or a gapless run folder: its method's final save built as the run built it
    (gapless.model.method.Method.load_final): a LoRA run's adapter/ on its config's model.path (or `base`), a QLoRA
    run's on that base quantised to NF4 as in training (`unquantised_base`: as the checkpoint holds it instead), a
    full run's model/. A run's adapter/ named directly loads as its run. `dtype` (default: on CUDA the run's
    model.dtype, else bfloat16; float32 on the CPU) is the dtype the model computes in."""
    from transformers import AutoTokenizer

    from gapless.config import RunConfig, from_dict, read_yaml, resolve_device
    from gapless.model.loading import load_model, read_config, resolve_dtype
    from gapless.model.lora import ADAPTER_CONFIG, load_adapter
    from gapless.model.method import method_of

    source = Path(source)
    # a folder with adapter_config.json is a PEFT adapter whatever lies beside it (a gapless run keeps its adapter in
    # adapter/): a training script's own config.yaml (Adarsh5557/qwen7b-finetuned-Smart-MCQ-Solver) or a config.json
    # (DeveloperZeeshu/Nano_R1-model) made it a run or a model folder; transformers' from_pretrained also reads such a
    # folder as the adapter on its base_model_name_or_path
    is_adapter = (source / ADAPTER_CONFIG).is_file()
    run_dir = source if (source / "config.yaml").is_file() and not (source / "config.json").is_file() \
        and not is_adapter else None
    if is_adapter and source.name == "adapter" and (source.parent / "config.yaml").is_file():
        run_dir = source.parent  # RUN/adapter: the run's final save, built as the run built it
    cfg = method = None
    adapter_dir = tokenizer_dir = None
    if run_dir is not None:
        run_config = run_dir / "config.yaml"
        cfg = from_dict(RunConfig, read_yaml(run_config), str(run_config))
        method = method_of(cfg)
        final = run_dir / method.final_name
        tokenizer_dir = Path(cfg.data.tokenizer or cfg.model.path)
        if not (final / ("config.json" if method.final_holds_base else ADAPTER_CONFIG)).is_file():
            raise ValueError(f"{run_dir}: the run has no {method.final_name}/ yet (it writes one when it ends); "
                             f"export a checkpoint first: gapless export {run_dir}/checkpoints/step-N --out DIR")
        if method.final_holds_base:  # every weight trained: the run's final save is an HF folder, model/
            base_dir = final
            if base is not None:
                warnings.warn(f"--base {base} is ignored: {run_dir} is a {method.name} run, whose "
                              f"{method.final_name}/ holds every weight", stacklevel=2)
        else:
            adapter_dir = final
            base_dir = Path(base or cfg.model.path)
            saved = json.loads((final / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
            if base is None and not (base_dir / "config.json").is_file() and (Path(saved) / "config.json").is_file():
                base_dir = Path(saved)  # model.path relative to another folder: the absolute path the adapter saved
        if unquantised_base and method.quantised_base is None:
            warnings.warn(f"--unquantised-base is ignored: {run_dir} is a {method.name} run, whose base is not "
                          "quantised", stacklevel=2)
    elif is_adapter:
        adapter_dir = source
        base_dir = Path(base or json.loads((source / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
    elif (source / "config.json").is_file():
        base_dir, tokenizer_dir = source, source
    elif not source.exists():
        raise ValueError(f"{source}: not found; give a run folder, an adapter folder or a model folder")
    elif (source / "manifest.json").is_file():
        raise ValueError(f"{source}: a training checkpoint; export it first (gapless export {source} --out DIR) and "
                         "generate from DIR")
    else:
        raise ValueError(f"{source}: not a model folder (config.json), an adapter folder ({ADAPTER_CONFIG}) or a "
                         "gapless run folder (config.yaml)")
    if unquantised_base and method is None:
        warnings.warn(f"--unquantised-base is ignored: {source} is not a gapless run folder, so its base is loaded "
                      "as its checkpoint holds it", stacklevel=2)
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"{source}: its base model {str(base_dir)!r} is not a local model folder; pass --base DIR")
    if tokenizer_dir is None or not any((tokenizer_dir / f).is_file() for f in ("tokenizer.json",
                                                                                   "tokenizer_config.json")):
        tokenizer_dir = adapter_dir if adapter_dir is not None and (adapter_dir / "tokenizer_config.json").is_file() \
            else base_dir
    # generation_config.json's eos_token_id(s) (Qwen2.5 instruct's [151645, 151643], where config.json and the
    # tokenizer name 151645 alone) in the model folder and in an adapter folder (a run's adapter/ and an exported one
    # hold a copy of its tokenizer folder's); read before the weights, so that a malformed file is named at once
    generation_eos = sorted({i for folder in (base_dir, adapter_dir) if folder is not None
                             for i in read_generation_eos(folder)})
    device = str(resolve_device(device, "--device"))
    on_cuda = device.startswith("cuda")
    # a run's own dtype on CUDA, so that generation and evaluation compute as the run did; float32 on the CPU
    # (its bfloat16 matmuls are slow, and float32 is the closer to any run); "auto": the base checkpoint's
    dtype = resolve_dtype(dtype or ((cfg.model.dtype if cfg is not None else "bfloat16") if on_cuda else "float32"),
                          read_config(base_dir))
    if method is not None:
        model, what = method.load_final(final, base_dir, dtype, device, unquantised_base=unquantised_base)
    else:
        model = load_model(base_dir, dtype=dtype, device=device)
        what = f"model {base_dir}"
        if adapter_dir is not None:
            model, _ = load_adapter(model, adapter_dir)
            what = f"adapter {adapter_dir} on {base_dir}"
    return Loaded(model.eval(), AutoTokenizer.from_pretrained(str(tokenizer_dir)), what, generation_eos)


def read_generation_eos(folder: str | Path) -> list[int]:
    """The eos_token_id(s) of `folder`'s generation_config.json (null, an id or a list of ids there); none without
    the file. Invalid JSON or another value is a ValueError naming the file and the field."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return []
    from gapless.model.loading import read_json_object, token_ids

    eos = token_ids(read_json_object(path), "eos_token_id", str(path))  # config.json's check
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


def stop_ids(loaded: Loaded) -> set[int]:
    """The tokens that end a turn: the tokenizer's eos, config.json's and generation_config.json's eos_token_id(s),
    the known end-of-turn marks."""
    tokenizer = loaded.tokenizer
    ids = set(loaded.generation_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    eos = loaded.model.args.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return ids


def encode_chat(tokenizer, messages: list[dict], raw: bool = False) -> list[int]:
    """The prompt's token ids: the chat template with the assistant's turn opened, or the text as is (`raw`)."""
    if not raw and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass --raw to continue plain text")
    try:
        if raw:
            return tokenizer(messages[-1]["content"], add_special_tokens=True)["input_ids"]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises a bare Exception)
        # e.g. a character outside a vocabulary without an unknown token (the demo's character tokenizer)
        if type(e) is not Exception:
            raise
        raise ValueError(f"the tokenizer cannot encode the prompt: {e}") from None


def decode(tokenizer, gen: Generation) -> str:
    tokens = gen.tokens[:-1] if gen.stopped == "end of turn" else gen.tokens
    return tokenizer.decode(tokens, skip_special_tokens=True)
