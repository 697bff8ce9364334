"""`gapless eval RUN`: a trained run's model on held-out data, written to RUN/eval.json.

Loss and perplexity go through the run's own data path (reader, chat template, masking, batching as its config
says, with --data as the sources) and the loop's `evaluate`: the mean cross-entropy per trained token, and its
exponential. Exact match (GSM8K) decodes greedily with the chat template and compares the number on the reply's
`#### N` line with the reference's; a reply without such a line counts as wrong (and is counted).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path

from gapless.config import SourceConfig

ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def final_number(text: str) -> str | None:
    """The number of the last `#### N` line, commas and a trailing `.0` removed; None without one."""
    found = ANSWER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def read_problems(path: str | Path, limit: int) -> list[tuple[str, str]]:
    """(question, reference answer) of GSM8K records: {question, answer}, or {messages: [user, assistant]}."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--gsm8k: {path} is not a file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if len(out) >= limit:
            break
        if not line.strip():
            continue
        row = json.loads(line)
        if "question" in row and "answer" in row:
            out.append((row["question"], row["answer"]))
        elif "messages" in row:
            turns = {m["role"]: m["content"] for m in row["messages"]}
            out.append((turns["user"], turns["assistant"]))
        else:
            raise ValueError(f"{path}:{n}: expected {{question, answer}} or {{messages}}, got {sorted(row)}")
    return out


def loss_on(run_dir: Path, cfg, model, paths: list[str], device) -> dict:
    from gapless.data.batching import BatchSampler
    from gapless.data.pipeline import build_data
    from gapless.train.loop import evaluate

    data = dataclasses.replace(cfg.data, sources=[SourceConfig(path=p) for p in paths], eval_sources=[],
                               eval_fraction=0.0)
    mix, _, summary = build_data(data, Path(cfg.data.tokenizer or cfg.model.path))
    batches = list(BatchSampler.for_eval(data, mix).epoch_batches(0))
    ev = evaluate(model, batches, device)
    return {"kind": "loss", "data": ", ".join(paths), "loss": ev["eval_loss"], "perplexity": math.exp(ev["eval_loss"]),
            "tokens": ev["eval_tokens"], "documents": len(mix)}


def exact_match(loaded, problems: list[tuple[str, str]], max_new_tokens: int, source: str) -> dict:
    from gapless.model.generate import decode, encode_chat, generate_ids, stop_ids

    stop = stop_ids(loaded)
    correct = missing = tokens = 0
    seconds = 0.0
    samples = []
    for question, reference in problems:
        gen = generate_ids(loaded.model, encode_chat(loaded.tokenizer, [{"role": "user", "content": question}]),
                           max_new_tokens=max_new_tokens, stop=stop)
        reply = decode(loaded.tokenizer, gen)
        got, want = final_number(reply), final_number(reference)
        correct += got is not None and got == want
        missing += got is None
        tokens += len(gen.tokens)
        seconds += gen.prefill_s + gen.decode_s
        if len(samples) < 3:
            samples.append({"question": question, "expected": want, "got": got, "reply": reply})
    total = len(problems)
    return {"kind": "exact_match", "data": source, "correct": correct, "total": total,
            "exact_match": correct / total if total else 0.0, "no_answer_line": missing,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "samples": samples}


def evaluate_run(run: str | Path, *, data: list[str] = (), gsm8k: str | None = None, limit: int = 50,
                 max_new_tokens: int = 320, device: str = "auto", unquantised_base: bool = False) -> list[dict]:
    """The evaluations asked for, each naming the model evaluated (for a QLoRA run the NF4 base it trained on, or
    with `unquantised_base` the base as its checkpoint holds it), appended to RUN/eval.json (a list of records, each
    with its time)."""
    from gapless.model.generate import load_for_generation
    from gapless.train.export import run_config_of

    run_dir = Path(run)
    cfg = run_config_of(run_dir)
    loaded = load_for_generation(run_dir, device=device, unquantised_base=unquantised_base)
    model_device = next(loaded.model.parameters()).device
    results = []
    if data:
        results.append(loss_on(run_dir, cfg, loaded.model, list(data), model_device))
    if gsm8k:
        results.append(exact_match(loaded, read_problems(gsm8k, limit), max_new_tokens, str(gsm8k)))
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results = [{**r, "model": loaded.what, "time": when} for r in results]
    path = run_dir / "eval.json"
    history = json.loads(path.read_text()) if path.is_file() else []
    history += results
    path.write_text(json.dumps(history, indent=1) + "\n")
    return results
