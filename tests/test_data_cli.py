"""`gapless data`: the summary, the histogram, a decoded example with the trained text marked, --json."""
import json

import yaml

from gapless.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["data", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_files_and_tokenizer_flags(shared, tmp_path, capsys):
    files = [shared / "data/messages/fastchat_dummy_conversation.jsonl",
             shared / "data/messages/self_instruct_user_oriented.jsonl"]
    code, out, _ = run(capsys, *files, "--tokenizer", shared / "tokenizers/llama3", "--set", f"cache_dir={tmp_path}",
                       "--set", "num_workers=0", "--example", 2, "--json")
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])  # the last line is the summary as one JSON object
    assert (summary["records"], summary["kept"], summary["truncated"], summary["dropped"]) == (752, 752, 0, {})
    assert [s["cache"] for s in summary["sources"]] == ["miss", "miss"]
    assert summary["tokens"] > summary["target_tokens"] > 0 and 0.9 < summary["packing_efficiency"] <= 1
    assert "packing efficiency:" in out and "document length (tokens)" in out
    # fastchat's third conversation, its assistant turns marked, the prompt not
    assert "example 2 (" in out
    assert ("«Hello! How can I help you today?<|eot_id|>»" in out
            and "«What is up?" not in out and "What is up?<|eot_id|>" in out)
    code, out, _ = run(capsys, *files, "--tokenizer", shared / "tokenizers/llama3", "--set", f"cache_dir={tmp_path}",
                       "--json")
    assert [s["cache"] for s in json.loads(out.strip().splitlines()[-1])["sources"]] == ["hit", "hit"]


def test_a_config_file_with_column_mapping_and_overrides(shared, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(shared / "tokenizers/qwen2")},  # the tokenizer defaults to the model folder
        "data": {"sources": [{"path": str(shared / "data/raw/gsm8k/train.jsonl"), "format": "prompt_completion",
                              "columns": {"prompt": "question", "completion": "answer"}}],
                 "cache_dir": str(tmp_path / "cache"), "batching": "padded"},
    }))
    code, out, _ = run(capsys, config, "--set", "max_seq_len=512", "--set", "tokens_per_batch=8192", "--json")
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["records"], summary["kept"], summary["max_seq_len"]) == (7473, 7473, 512)
    assert summary["batching"] == "padded"
    assert summary["truncated"] == 3  # the three gsm8k problems of 512+ Qwen2 tokens
    assert "«Natalia sold 48/2 = <<48/2=24>>24 clips in May." in out
    # 2 documents per batch (a peer's per-device batch size, unpacked): 3,737 batches of the 7,473, not as many as fit
    code, out, _ = run(capsys, config, "--set", "max_seq_len=512", "--set", "tokens_per_batch=8192", "--set",
                       "rows_per_batch=2")
    assert code == 0 and "3,737 batches of up to 2 documents in up to 8,192 slots (padded, max_seq_len 512)" in out


def test_bad_input_stops_with_file_and_line_or_is_counted(tmp_path, shared, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
                    '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}\n')
    args = [path, "--tokenizer", shared / "tokenizers/llama3", "--set", f"cache_dir={tmp_path / 'c'}"]
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith(f"gapless data: error: {path}:2: messages[1].role: unknown role 'bot'")
    code, out, err = run(capsys, *args, "--set", "on_error=skip", "--json")
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["records"], summary["kept"], summary["dropped"]) == (2, 1, {"unknown_role": 1})
    assert f"{path}:2: messages[1].role: unknown role 'bot'" in out  # listed among the first skipped records


def test_a_bad_setting_names_the_field(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "x.jsonl", "--set", "batching=packd")
    assert code == 2 and "data.batching: 'packd' is not one of" in err and "did you mean 'packed'" in err


def test_a_missing_tokenizer_names_the_flag(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "x.jsonl")
    assert code == 2 and "data.tokenizer: not set; give --tokenizer DIR" in err
    # the example config's placeholder model.path: not "data.tokenizer: ... is not a folder", a field it does not set
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "models/Llama-3.2-3B-Instruct"},
                                      "data": {"sources": [{"path": str(tmp_path / "x.jsonl")}]}}))
    code, _, err = run(capsys, config)
    assert code == 2 and "model.path: models/Llama-3.2-3B-Instruct is not a folder" in err and "--tokenizer" in err


def test_when_no_record_fits_the_summary_says_why_before_the_error(tmp_path, shared, capsys):
    """`gapless data` stopped on "no training documents" with nothing printed, its message pointing at `gapless data`
    itself; records longer than max_seq_len (SQuALITY's stories under the default 4,096) said nothing of it."""
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "story " * 40},
                                                     {"role": "assistant", "content": "short"}]}) + "\n"
                            for _ in range(2)))
    code, out, err = run(capsys, path, "--tokenizer", shared / "tokenizers/llama3", "--set", f"cache_dir={tmp_path}",
                         "--set", "max_seq_len=16", "--set", "tokens_per_batch=16", "--set", "num_workers=0")
    assert code == 2 and "dropped by reason: truncated_away 2" in out and "(no documents)" in out
    assert "2 records did not fit data.max_seq_len 16 (truncated_away: their answers lay past it), raise it" in err


def test_native_oasst_and_self_instruct_files(shared, tmp_path, capsys):
    """OpenAssistant's trees (all threads, or --format oasst_top1) and Self-Instruct's instances, auto-detected: the
    626 threads and 252 instances that data/messages/ derived from them, less the 62 threads that repeat another of
    their tree once cut to their last answer (skipped and counted)."""
    raw = shared / "data/raw"
    args = ["--tokenizer", shared / "tokenizers/llama3", "--set", f"cache_dir={tmp_path}", "--set", "num_workers=0",
            "--json"]
    oasst, self_instruct = raw / "oasst_en100/en_100_tree.jsonl", raw / "self_instruct/user_oriented_instructions.jsonl"
    code, out, _ = run(capsys, oasst, self_instruct, *args)
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert [(s["records"], s["kept"]) for s in summary["sources"]] == [(626, 564), (252, 252)]
    assert summary["dropped"] == {"duplicate_thread": 62} and summary["target_tokens"] > 0
    code, out, _ = run(capsys, oasst, "--format", "oasst_top1", *args)
    assert code == 0
    assert json.loads(out.strip().splitlines()[-1])["kept"] == 100  # one thread a tree


def test_a_config_takes_dotted_overrides_as_train_does(shared, tmp_path, capsys):
    """`gapless data CONFIG model.path=... data.sources.0.path=...`, as `gapless train` takes them, read the
    overrides as data files: the config itself became a source and the error was "data.tokenizer: not set"."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "models/Llama-3.2-3B-Instruct"},
                                      "data": {"sources": [{"path": "data/train.jsonl"}], "max_seq_len": 4096}}))
    code, out, _ = run(capsys, config, f"model.path={shared / 'tokenizers/llama3'}",
                       f"data.sources.0.path={shared / 'data/messages/fastchat_dummy_conversation.jsonl'}",
                       "data.max_seq_len=512", f"data.cache_dir={tmp_path / 'cache'}", "--json")
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["max_seq_len"] == 512 and summary["records"] == 500  # fastchat_dummy_conversation.jsonl
    # a data file beside a config is neither: named, not read as a source
    code, _, err = run(capsys, config, shared / "data/messages/fastchat_dummy_conversation.jsonl")
    assert code == 2 and "fastchat_dummy_conversation.jsonl: not a key=value override" in err
