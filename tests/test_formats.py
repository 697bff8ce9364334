"""Readers: the native files in ../shared/data/raw equal their messages/ twins; every file type;
every kind of bad record named by file:line and field."""
import csv
import json

import pytest

from gapless.config import DataConfig, SourceConfig, from_dict
from gapless.data.formats import Example, RecordError, Skipped, read_source, resolve_files

GSM8K_COLUMNS = {"prompt": "question", "completion": "answer"}
# raw file, how to read it, the messages/ file it must equal
RAW_CASES = [
    ("gpteacher/codegen-instruct.json", {"format": "alpaca"}, "gpteacher_codegen"),
    ("gpteacher/roleplay-simple-deduped-roleplay-instruct.json", {"format": "alpaca"}, "gpteacher_roleplay"),
    ("gsm8k/train.jsonl", {"format": "prompt_completion", "columns": GSM8K_COLUMNS}, "gsm8k_train"),
    ("fastchat_dummy/dummy_conversation.json", {"format": "sharegpt"}, "fastchat_dummy_conversation"),
    # function_call -> assistant tool call, observation -> tool: the default ShareGPT role map
    ("glaive_toolcall_demo/glaive_toolcall_en_demo.json", {"format": "sharegpt"}, "glaive_toolcall_en_demo"),
    # auto-detected: OpenAssistant's trees (626 root-to-leaf threads of 100 trees, 564 once the threads that repeat
    # another of their tree are skipped), Self-Instruct's instances
    ("oasst_en100/en_100_tree.jsonl", {}, "oasst_en100_threads"),
    ("self_instruct/user_oriented_instructions.jsonl", {}, "self_instruct_user_oriented"),
]


def examples(src: SourceConfig) -> list:
    return list(read_source(src))


@pytest.mark.parametrize("raw,options,reference", RAW_CASES, ids=[c[2] for c in RAW_CASES])
def test_raw_files_equal_their_messages_twins(shared, raw, options, reference):
    got = [e for e in examples(SourceConfig(path=str(shared / "data/raw" / raw), **options))
           if not (isinstance(e, Skipped) and e.reason == "duplicate_thread")]
    lines = [json.loads(line) for line in open(shared / f"data/messages/{reference}.jsonl")]
    # messages/ keeps the OpenAssistant threads that repeat another of their tree; the reader skips all but the first
    key = {i: (w["tree_id"], json.dumps(w["messages"])) for i, w in enumerate(lines) if "tree_id" in w}
    first = {k: i for i, k in reversed(key.items())}
    kept = [i for i in range(len(lines)) if i not in key or first[key[i]] == i]
    want = [lines[i] for i in kept]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, Example), g
        assert g.messages == w["messages"], g.where
        assert g.tools == (json.loads(w["tools"]) if "tools" in w else None), g.where
    # the messages/ file itself, read as messages format (auto-detected), gives the same records
    again = examples(SourceConfig(path=str(shared / f"data/messages/{reference}.jsonl")))
    assert [again[i].messages for i in kept] == [g.messages for g in got]


def test_auto_detects_sharegpt_and_maps_roles(shared):
    got = examples(SourceConfig(path=str(shared / "data/raw/glaive_toolcall_demo/glaive_toolcall_en_demo.json")))
    roles = {m["role"] for e in got for m in e.messages}
    assert roles == {"user", "assistant", "tool"}
    assert sum(bool(m.get("is_tool_call")) for e in got for m in e.messages) == 211  # the 211 function_call turns


RECORDS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi, \"you\""},
                  {"role": "assistant", "content": "hello\nthere"}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
]


def write_all_types(folder):
    """The same two records as .jsonl, .json, .csv, .parquet and a datasets save_to_disk folder."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (folder / "b.json").write_text(json.dumps(RECORDS, indent=2))
    with open(folder / "c.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        for r in RECORDS:
            w.writerow([json.dumps(r["messages"])])
    table = pa.table({"messages": [r["messages"] for r in RECORDS]})
    pq.write_table(table, folder / "d.parquet")
    ds = folder / "saved"  # what datasets.Dataset.save_to_disk writes: Arrow stream shards + state.json
    ds.mkdir()
    with pa.ipc.new_stream(str(ds / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    return folder


def test_every_file_type_reads_the_same_records(tmp_path):
    folder = write_all_types(tmp_path / "d")
    want = [r["messages"] for r in RECORDS]
    for path in ["a.jsonl", "b.json", "c.csv", "d.parquet", "saved"]:
        got = examples(SourceConfig(path=str(folder / path)))
        assert [e.messages for e in got] == want, path
    # a glob and a plain folder: every matching file, sorted
    assert len(examples(SourceConfig(path=str(folder / "*.json*")))) == 4
    assert [f.name for f in resolve_files(str(folder))] == ["a.jsonl", "b.json", "c.csv", "d.parquet"]
    # line numbers: JSONL lines, the line each JSON array element starts on, the CSV line of the record
    assert [e.where.rsplit(":", 1)[1] for e in examples(SourceConfig(path=str(folder / "b.json")))] == ["2", "18"]
    assert [e.where.rsplit(":", 1)[1] for e in examples(SourceConfig(path=str(folder / "c.csv")))] == ["2", "3"]
    assert examples(SourceConfig(path=str(folder / "saved")))[1].where.endswith("row 1")


def test_every_format_and_column_mapping(tmp_path):
    rows = {
        "alpaca.jsonl": ({"instruction": "Sum", "input": "2 2", "output": "4", "system": "S"},
                         [{"role": "system", "content": "S"}, {"role": "user", "content": "Sum\n\n2 2"},
                          {"role": "assistant", "content": "4"}]),
        "pc.jsonl": ({"q": "Why?", "a": "Because."},
                     [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]),
        "sg.jsonl": ({"conv": [{"speaker": "me", "text": "yo"}, {"speaker": "bot", "text": "hey"}], "system": "Sys"},
                     [{"role": "system", "content": "Sys"}, {"role": "user", "content": "yo"},
                      {"role": "assistant", "content": "hey"}]),
    }
    for name, (row, _) in rows.items():
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    (tmp_path / "t.jsonl").write_text(json.dumps({"body": "plain text"}) + "\n")
    sources = {
        "alpaca.jsonl": SourceConfig(path=str(tmp_path / "alpaca.jsonl")),  # auto: has `instruction`
        "pc.jsonl": SourceConfig(path=str(tmp_path / "pc.jsonl"), format="prompt_completion",
                                 columns={"prompt": "q", "completion": "a"}),
        "sg.jsonl": SourceConfig(path=str(tmp_path / "sg.jsonl"), format="sharegpt",
                                 columns={"conversations": "conv", "from": "speaker", "value": "text"},
                                 roles={"me": "user", "bot": "assistant"}),
    }
    for name, src in sources.items():
        assert examples(src)[0].messages == rows[name][1], name
    text = examples(SourceConfig(path=str(tmp_path / "t.jsonl"), format="text", columns={"text": "body"}))
    assert text[0].text == "plain text" and text[0].messages is None


BAD = [  # (line written into a JSONL file, reason, what the message names)
    # the column is the line's own, where the record breaks off (not column 1 of the newline after it)
    ('{"messages": [{"role": "user", "content": "a"}', "malformed_json", "not valid JSON (Expecting ',' delimiter "
                                                                         "at column 47)"),
    ('{"messages": []} }', "malformed_json", "not valid JSON (Extra data at column 18)"),
    ('{"conversation": []}', "missing_field", "messages: missing"),
    ('{"messages": [{"role": "user"}]}', "missing_field", "messages[0].content: missing"),
    ('{"messages": [{"content": "x"}]}', "missing_field", "messages[0].role: missing"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "unknown_role", "messages[0].role: unknown role 'bot'"),
    ('{"messages": []}', "empty_conversation", "messages: empty conversation"),
    ('{"messages": [{"role": "user", "content": 3}]}', "bad_value", "messages[0].content: expected a string"),
    ('[1, 2]', "bad_value", "expected a JSON object"),
]


@pytest.mark.parametrize("line,reason,text", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_records_name_file_line_and_field(tmp_path, line, reason, text):
    good = json.dumps(RECORDS[1])
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n")  # the bad record is on line 3
    got = examples(SourceConfig(path=str(path), format="messages"))
    assert [type(x) for x in got] == [Example, RecordError, Example]
    err = got[1]
    assert err.reason == reason
    assert str(err).startswith(f"{path}:3: ") and text in str(err)


def test_broken_json_array_stops_with_its_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n {"text": "a"},\n {"text": "b",,}\n]')
    with pytest.raises(ValueError, match=r"broken.json:3: not valid JSON"):
        examples(SourceConfig(path=str(path), format="text"))


def test_paths_and_formats_that_cannot_be_read(tmp_path):
    with pytest.raises(ValueError, match="no files match"):
        resolve_files(str(tmp_path / "*.jsonl"))
    with pytest.raises(ValueError, match="no such file"):
        resolve_files(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        resolve_files(str(tmp_path / "x.txt"))
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(ValueError, match=r"DatasetDict folder with splits \['train', 'test'\]"):
        resolve_files(str(dd))
    (tmp_path / "q.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:1: cannot tell the format .*prompt_completion"):
        examples(SourceConfig(path=str(tmp_path / "q.jsonl")))


def test_a_folder_of_a_datasets_splits_is_not_read_whole(tmp_path):
    """train.jsonl beside test.jsonl (a downloaded dataset): reading the folder trained on the held-out split too,
    silently. It is an error that names the splits and the path to give; one split, or other names, read whole."""
    row = '{"text": "a"}\n'
    for name in ("train.jsonl", "test.jsonl", "validation-00000-of-00001.jsonl", "notes.jsonl"):
        (tmp_path / name).write_text(row)
    (tmp_path / "train_README.md").write_text("not data")
    with pytest.raises(ValueError, match=r"holds the splits of a dataset \(train: train.jsonl; validation: "
                                         r"validation-00000-of-00001.jsonl; test: test.jsonl\); point the path at the "
                                         r"training files \(.*train.jsonl\) and give the others as "
                                         r"data.eval_sources"):
        resolve_files(str(tmp_path))
    for name in ("test.jsonl", "validation-00000-of-00001.jsonl"):
        (tmp_path / name).unlink()
    assert [f.name for f in resolve_files(str(tmp_path))] == ["notes.jsonl", "train.jsonl"]  # one split: whole
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("# a dataset card")
    (hub / "data" / "train-00000-of-00001.jsonl").write_text(row)
    with pytest.raises(ValueError, match=r"folder has no .* files; its data/ folder \(a Hub dataset's layout\) has 1, "
                                         r"e.g. train-00000-of-00001.jsonl"):
        resolve_files(str(hub))


def test_config_errors_name_the_field():
    def error(data: dict) -> str:
        with pytest.raises(ValueError) as e:
            from_dict(DataConfig, data, "data")
        return str(e.value)

    src = {"path": "x.jsonl"}
    assert error({"sources": []}).startswith("data.sources:")
    assert error({"sources": [{**src, "format": "sharegtp"}]}).startswith(
        "data.sources[0].format: 'sharegtp' is not one of")
    assert "did you mean 'sharegpt'" in error({"sources": [{**src, "format": "sharegtp"}]})
    assert error({"sources": [{**src, "format": "alpaca", "columns": {"prompt": "q"}}]}).startswith(
        "data.sources[0].columns.prompt: not a field of format 'alpaca'")
    assert error({"sources": [{**src, "roles": {"bot": "assistent"}}]}).startswith("data.sources[0].roles.bot:")
    assert error({"sources": [{**src, "weight": 1.0, "epochs": 2.0}]}).startswith("data.sources[0]: set weight")
    assert error({"sources": [src], "max_seq_len": 32768}).startswith("data.tokens_per_batch:")
    assert error({"sources": [src], "eval_fraction": 1.0}).startswith("data.eval_fraction:")
    assert error({"sources": [src], "chat_template": "nope.jinja"}).startswith("data.chat_template: file")
    assert error({"sources": [src], "train_on": "assistants"}).startswith("data.train_on:")


def test_common_hub_shapes_read(tmp_path):
    """A folder of files of different formats (auto is per file, as documented: it was decided once per source, so
    the second format's records failed), OpenAI's content parts, TRL's conversational prompt-completion."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    (folder / "b.jsonl").write_text(json.dumps({"instruction": "hi", "input": "", "output": "yo"}) + "\n")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert [e.messages for e in examples(SourceConfig(path=str(folder)))] == [chat, chat]

    parts = tmp_path / "parts.jsonl"
    parts.write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                                   {"role": "assistant", "content": "yo"}]}) + "\n")
    got = examples(SourceConfig(path=str(parts)))
    assert got[0].messages == chat
    assert isinstance(got[1], RecordError) and got[1].where.endswith("parts.jsonl:2")
    assert "messages[0].content[0]: a 'image_url' content part" in str(got[1])

    pc = tmp_path / "pc.jsonl"
    pc.write_text(json.dumps({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                              "completion": [{"role": "assistant", "content": "yo"}]}) + "\n")
    assert examples(SourceConfig(path=str(pc)))[0].messages == [{"role": "system", "content": "s"}, *chat]


def test_gzipped_json_reads_as_its_text(tmp_path):
    import gzip

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(3)]
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "arr.json.gz", "wt") as f:
        f.write(json.dumps(rows, indent=1))
    for name in ("train.jsonl.gz", "arr.json.gz"):
        got = examples(SourceConfig(path=str(tmp_path / name)))
        assert [e.messages for e in got] == [r["messages"] for r in rows], name
    assert examples(SourceConfig(path=str(tmp_path / "train.jsonl.gz")))[2].where.endswith("train.jsonl.gz:3")
    assert [f.name for f in resolve_files(str(tmp_path))] == ["arr.json.gz", "train.jsonl.gz"]
    (tmp_path / "bad.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00broken")
    with pytest.raises(ValueError, match="bad.jsonl.gz: not a readable gzip file"):
        examples(SourceConfig(path=str(tmp_path / "bad.jsonl.gz")))
    (tmp_path / "x.jsonl.zst").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"x.jsonl.zst: unsupported file type '.zst'.*decompress it first"):
        resolve_files(str(tmp_path / "x.jsonl.zst"))


def test_drop_system_message_drops_the_leading_system_turn_only(tmp_path):
    """SourceConfig.drop_system_message (Axolotl's): the first turn when it is a system one, the format's system field
    included; a later system turn stays; plain text has none to drop (refused)."""
    system, later = {"role": "system", "content": "S"}, {"role": "system", "content": "Now in French."}
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": [system, user, answer, later, user, answer]}) + "\n"
                                      + json.dumps({"messages": [user, answer]}) + "\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"instruction": "hi", "output": "yo", "system": "S"}) + "\n")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "plain"}) + "\n")
    kept = examples(SourceConfig(path=str(tmp_path / "m.jsonl")))
    assert kept[0].messages[0] == system
    dropped = examples(SourceConfig(path=str(tmp_path / "m.jsonl"), drop_system_message=True))
    assert [e.messages for e in dropped] == [[user, answer, later, user, answer], [user, answer]]
    assert examples(SourceConfig(path=str(tmp_path / "a.jsonl"), drop_system_message=True))[0].messages == \
        [{"role": "user", "content": "hi"}, answer]
    with pytest.raises(ValueError, match=r"t\.jsonl:1: plain text .* sets drop_system_message"):
        examples(SourceConfig(path=str(tmp_path / "t.jsonl"), drop_system_message=True))
    with pytest.raises(ValueError, match="source.drop_system_message: format text has no system turn"):
        from_dict(SourceConfig, {"path": "t.jsonl", "format": "text", "drop_system_message": True}, "source")


def test_a_utf8_bom_and_crlf_line_ends_read_in_every_text_file_type(tmp_path):
    """Windows tools write both: PowerShell's and Notepad's UTF-8 a BOM, Excel's "CSV UTF-8" a BOM and CRLF. A JSON
    array behind a BOM was read as JSON lines (every line a malformed record); a CSV's BOM opened its first column's
    name ('\\ufeffmessages'), so no format matched."""
    bom = b"\xef\xbb\xbf"
    files = {
        "a.jsonl": bom + b"\r\n" + "".join(json.dumps(r) + "\r\n" for r in RECORDS).encode(),  # a blank first line
        "b.json": bom + json.dumps(RECORDS, indent=2).replace("\n", "\r\n").encode(),
        "c.json": bom + json.dumps(RECORDS[0]).encode(),
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with open(tmp_path / "d.csv", "w", newline="", encoding="utf-8-sig") as f:  # csv's default line end is \r\n
        w = csv.writer(f)
        w.writerow(["messages"])
        for r in RECORDS:
            w.writerow([json.dumps(r["messages"])])
    want = [r["messages"] for r in RECORDS]
    for name, lines in [("a.jsonl", ["2", "3"]), ("b.json", ["2", "18"]), ("c.json", ["1"]), ("d.csv", ["2", "3"])]:
        got = examples(SourceConfig(path=str(tmp_path / name)))
        assert all(isinstance(e, Example) for e in got), [str(e) for e in got]
        assert [e.messages for e in got] == want[:len(lines)], name
        assert [e.where.rsplit(":", 1)[1] for e in got] == lines, name


def test_null_keys_of_a_datasets_export_are_absent_ones(tmp_path):
    """datasets' to_json and to_parquet give every turn every key that any turn has, null where it had none: OpenAI's
    weight 0 on one answer made `"weight": null` on every other turn, each record refused as a bad weight."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no", "weight": 0},
             {"role": "user", "content": "again"},
             {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]}]
    keys = ["role", "content", "weight", "tool_calls"]
    exported = [{k: t.get(k) for k in keys} for t in turns]
    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": exported}) + "\n")
    pq.write_table(pa.table({"messages": [exported]}), tmp_path / "b.parquet")
    for name in ("a.jsonl", "b.parquet"):
        got = examples(SourceConfig(path=str(tmp_path / name)))
        assert isinstance(got[0], Example), str(got[0])
        assert got[0].messages == turns, name


def test_openai_legacy_function_calling_and_developer_role_read_as_tools(tmp_path):
    """OpenAI's fine-tuning files from before tool_calls (an assistant `function_call` beside a null content, role
    `function`, top-level `functions`) and its `developer` role were refused: a missing content, an unknown role."""
    call = {"name": "weather", "arguments": '{"city": "Oslo"}'}
    spec = {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    legacy = {"functions": [spec], "messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "weather", "content": "rain"}, {"role": "assistant", "content": "Rain."}]}
    (tmp_path / "legacy.jsonl").write_text(json.dumps(legacy) + "\n")
    got = examples(SourceConfig(path=str(tmp_path / "legacy.jsonl")))[0]
    assert isinstance(got, Example), str(got)
    assert got.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "name": "weather", "content": "rain"}, {"role": "assistant", "content": "Rain."}]
    assert got.tools == [{"type": "function", "function": spec}]


def test_turn_keys_and_list_names_as_hub_datasets_mix_them(tmp_path):
    """ShareGPT's from/value turns under `messages`, role/content turns under `conversations`, and lmsys-chat-1m's
    and WildChat's `conversation`: each was refused (a missing role or from; no format detected)."""
    want = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    rows = {"a.jsonl": {"messages": sharegpt}, "b.jsonl": {"conversations": want},
            "c.jsonl": {"conversation_id": "x", "model": "m", "conversation": want, "turn": 1}}
    for name, row in rows.items():
        (tmp_path / name).write_text(json.dumps(row) + "\n")
        got = examples(SourceConfig(path=str(tmp_path / name)))
        assert isinstance(got[0], Example), str(got[0])
        assert got[0].messages == want, name
    # mapped keys are kept to: a turn without them is named
    got = examples(SourceConfig(path=str(tmp_path / "b.jsonl"), format="sharegpt", columns={"from": "speaker"}))
    assert "conversations[0].speaker: missing" in str(got[0])


def test_alpaca_variants_keep_every_part_of_the_prompt(tmp_path):
    """Dolly's `context` and LLaMA-Factory's `history` were read as unknown columns and left out without a word: the
    answer trained without the passage it answers from, or without the turns before it."""
    (tmp_path / "dolly.jsonl").write_text(json.dumps(
        {"instruction": "Who?", "context": "Ann wrote it.", "response": "Ann.", "category": "closed_qa"}) + "\n")
    assert examples(SourceConfig(path=str(tmp_path / "dolly.jsonl")))[0].messages == [
        {"role": "user", "content": "Who?\n\nAnn wrote it."}, {"role": "assistant", "content": "Ann."}]
    (tmp_path / "lf.jsonl").write_text(
        json.dumps({"instruction": "And 3?", "input": "", "output": "9", "system": "S",
                    "history": [["2?", "4"], ["And 1?", "1"]]}) + "\n"
        + json.dumps({"instruction": "q", "output": "a", "history": [["only the question"]]}) + "\n")
    got = examples(SourceConfig(path=str(tmp_path / "lf.jsonl")))
    assert got[0].messages == [{"role": "system", "content": "S"}] + [
        {"role": r, "content": c} for r, c in [("user", "2?"), ("assistant", "4"), ("user", "And 1?"),
                                               ("assistant", "1"), ("user", "And 3?"), ("assistant", "9")]]
    assert isinstance(got[1], RecordError) and got[1].reason == "bad_value"
    assert str(got[1]).startswith(f"{tmp_path / 'lf.jsonl'}:2: history: expected a list of [user, assistant] pairs")


def test_optional_fields_mapped_to_null_are_not_read(tmp_path):
    """columns {FIELD: null}: a record's system, tools, alpaca input or history is left out, as LLaMA-Factory leaves
    out the columns its dataset_info.json does not name; a history under another name is mapped like any field. A
    field every record needs cannot be null."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    (tmp_path / "a.jsonl").write_text(json.dumps({"instruction": "And 3?", "input": "x", "output": "9", "system": "S",
                                                  "history": [["2?", "4"]], "turns": [["1?", "1"]]}) + "\n")
    (tmp_path / "s.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "q"},
                                                                    {"from": "gpt", "value": "a"}],
                                                  "system": "S", "tools": tools}) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "a"}],
                                                  "tools": tools, "functions": [tools[0]["function"]]}) + "\n")
    qa = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    got = examples(SourceConfig(path=str(tmp_path / "a.jsonl"), format="alpaca",
                                columns={"system": None, "history": None, "input": None}))[0]
    assert got.messages == [{"role": "user", "content": "And 3?"}, {"role": "assistant", "content": "9"}]
    got = examples(SourceConfig(path=str(tmp_path / "a.jsonl"), format="alpaca", columns={"history": "turns"}))[0]
    assert [m["content"] for m in got.messages] == ["S", "1?", "1", "And 3?\n\nx", "9"]
    got = examples(SourceConfig(path=str(tmp_path / "s.jsonl"), columns={"system": None, "tools": None}))[0]
    assert (got.messages, got.tools) == (qa, None)
    got = examples(SourceConfig(path=str(tmp_path / "s.jsonl")))[0]  # unmapped, both read
    assert got.messages[0] == {"role": "system", "content": "S"} and got.tools
    got = examples(SourceConfig(path=str(tmp_path / "m.jsonl"), format="messages", columns={"tools": None}))[0]
    assert (got.messages, got.tools) == (qa, None)  # nor the legacy functions in its place
    with pytest.raises(ValueError, match=r"^source.columns.instruction: null \(not read\) is for the fields a record "
                                         r"may leave out \(input, system, history\)"):
        SourceConfig(path="x", format="alpaca", columns={"instruction": None}).validate()
    from_dict(DataConfig, {"sources": [{"path": "x", "columns": {"system": None}}]}, "data")  # auto: any optional


def test_a_csv_cell_as_long_as_a_json_record_reads(tmp_path):
    """csv's default field limit (128 KiB) refused a whole CSV over one long document that a JSON line holds."""
    story = "word " * 60_000  # 300,000 characters
    with open(tmp_path / "long.csv", "w", newline="") as f:
        csv.writer(f).writerows([["prompt", "completion"], [story, "a summary"], ["hi", "yo"]])
    got = examples(SourceConfig(path=str(tmp_path / "long.csv")))
    assert [e.messages[0]["content"] for e in got] == [story, "hi"]


def msg(role: str, text: str, *replies: dict, **extra) -> dict:
    """An OpenAssistant export message."""
    return {"message_id": text, "role": role, "text": text, "replies": list(replies), **extra}


def test_oasst_trees_give_their_threads(tmp_path):
    """OpenAssistant's message trees: every root-to-leaf thread, ending on an assistant turn; deleted and rejected
    messages left out with their replies; an unanswered prompt skipped (counted, not raised); oasst_top1 one thread
    a tree, the lowest rank at each step. Such a file was refused: no format could be detected."""
    tree = msg("prompter", "q",
               msg("assistant", "a1", msg("prompter", "follow"), msg("prompter", "more", msg("assistant", "a3")),
                   msg("prompter", "follow again"), rank=1),
               msg("assistant", "a2", rank=0),
               msg("assistant", "gone", msg("prompter", "under gone", msg("assistant", "x")), deleted=True, rank=2),
               msg("assistant", "rejected", review_result=False))
    rows = [{"message_tree_id": "t1", "tree_state": "ready_for_export", "prompt": tree},
            {"message_tree_id": "t2", "tree_state": "growing", "prompt": msg("prompter", "nobody answered")},
            {"message_tree_id": "t3", "prompt": msg("prompter", "spam", msg("assistant", "y"), deleted=True)},
            {"message_tree_id": "t4", "prompt": msg("prompter", "q", msg("bot", "z"))}]
    path = tmp_path / "trees.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def chat(*texts):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]

    got = examples(SourceConfig(path=str(path)))  # auto: oasst
    assert [(type(e).__name__, e.where.split("/")[-1]) for e in got] == [
        ("Example", "trees.jsonl:1 thread 1"), ("Example", "trees.jsonl:1 thread 2"),
        ("Skipped", "trees.jsonl:1 thread 3"), ("Example", "trees.jsonl:1 thread 4"),
        ("Skipped", "trees.jsonl:2 thread 1"), ("Skipped", "trees.jsonl:3"), ("RecordError", "trees.jsonl:4")]
    assert [e.messages for e in got if isinstance(e, Example)] == [chat("q", "a1"), chat("q", "a1", "more", "a3"),
                                                                   chat("q", "a2")]
    # one group, held out together by data.eval_fraction: the threads share "q" and a1
    assert {e.group for e in got if isinstance(e, Example)} == {"message_tree_id t1"}
    # "follow again" unanswered: cut to a1, thread 1 again, which would train a1 twice
    assert got[2].reason == "duplicate_thread" and "thread 1" in str(got[2])
    assert got[4].reason == got[5].reason == "no_assistant_turn"
    assert got[6].reason == "unknown_role" and "prompt.replies[0].role: expected one of" in str(got[6])

    top = examples(SourceConfig(path=str(path), format="oasst_top1"))
    assert top[0].messages == chat("q", "a2") and top[0].where.endswith("trees.jsonl:1")
    assert [type(e).__name__ for e in top] == ["Example", "Skipped", "Skipped", "RecordError"]


def test_unanswered_oasst_prompts_are_counted_not_raised(tmp_path):
    """A Skipped thread is dropped and counted by reason in the summary, under on_error: raise too (an unanswered
    prompt is an ordinary part of an OpenAssistant export, not a mistake in the file)."""
    from gapless import demo_task
    from gapless.data.pipeline import build_data

    rows = [{"message_tree_id": "t1", "prompt": msg("prompter", "ab", msg("assistant", "cd"), msg("assistant", "ef"))},
            {"message_tree_id": "t2", "prompt": msg("prompter", "no answer yet")}]
    path = tmp_path / "trees.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = demo_task.write_tokenizer(tmp_path / "tok")
    cfg = from_dict(DataConfig, {"sources": [{"path": str(path)}], "tokenizer": str(tok), "num_workers": 0,
                                 "cache_dir": str(tmp_path / "cache"), "max_seq_len": 64, "tokens_per_batch": 128},
                    "data")
    mix, _, summary = build_data(cfg)
    assert (summary.records, summary.kept, summary.dropped, len(mix)) == (3, 2, {"no_assistant_turn": 1}, 2)


def test_oasst_top1_takes_the_rank_0_path_of_each_real_tree(shared):
    trees = [json.loads(line) for line in open(shared / "data/raw/oasst_en100/en_100_tree.jsonl")]
    top = examples(SourceConfig(path=str(shared / "data/raw/oasst_en100/en_100_tree.jsonl"), format="oasst_top1"))
    assert len(top) == 100 and all(isinstance(e, Example) for e in top)
    for tree, ex in zip(trees, top):
        message, want = tree["prompt"], []
        while True:
            want.append(message["text"])
            if not message["replies"]:
                break
            message = next(r for r in message["replies"] if r.get("rank", 0) == 0)
        assert [m["content"] for m in ex.messages] == want[:len(ex.messages)], ex.where
        assert ex.messages[-1]["role"] == "assistant"


def test_self_instruct_instances_are_one_example_each(tmp_path):
    """Self-Instruct's rows ({"instruction", "instances": [{"input", "output"}]}, no `output`) were refused as an
    alpaca row missing its output."""
    (tmp_path / "si.jsonl").write_text(json.dumps(
        {"id": "t0", "motivation_app": "x", "instruction": "Fix it.",
         "instances": [{"input": "teh cat", "output": "the cat"}, {"input": "", "output": "Nothing to fix."},
                       {"input": "no output"}, "not an object"]}) + "\n"
        + json.dumps({"instruction": "a", "instances": []}) + "\n")
    got = examples(SourceConfig(path=str(tmp_path / "si.jsonl")))  # auto: alpaca
    assert [e.where.split("/")[-1] for e in got] == [f"si.jsonl:1 instance {k}" for k in (1, 2, 3, 4)] + ["si.jsonl:2"]
    assert got[0].messages == [{"role": "user", "content": "Fix it.\n\nteh cat"},
                               {"role": "assistant", "content": "the cat"}]
    assert got[1].messages == [{"role": "user", "content": "Fix it."},
                               {"role": "assistant", "content": "Nothing to fix."}]
    assert isinstance(got[2], RecordError) and "instances[2].output: missing" in str(got[2])
    assert isinstance(got[3], RecordError) and "instances[3]: expected an object" in str(got[3])
    assert got[4].reason == "empty_conversation" and "instances: no instances" in str(got[4])
    # one group, held out together by data.eval_fraction: the instances share "Fix it."
    assert got[0].group == got[1].group == got[0].where.rsplit(" instance", 1)[0]
    # mapped, as any other column
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"instruction": "Fix it.",
                                                      "tasks": [{"input": "", "output": "ok"}]}))
    got = examples(SourceConfig(path=str(tmp_path / "tasks.jsonl"), format="alpaca", columns={"instances": "tasks"}))
    assert got[0].messages == [{"role": "user", "content": "Fix it."}, {"role": "assistant", "content": "ok"}]


def test_pretty_printed_json_saved_as_jsonl_says_so(tmp_path):
    """json.dump(indent=2) or `jq .` output named .jsonl failed on line 1 with a bare "not valid JSON"."""
    for name, doc in [("obj.jsonl", RECORDS[0]), ("arr.jsonl", RECORDS)]:
        (tmp_path / name).write_text(json.dumps(doc, indent=2) + "\n")
        with pytest.raises(ValueError, match=rf"{name}:1: not JSON lines: the file looks like one pretty-printed JSON "
                                             r"document .* save it as \.json, or write one object per line"):
            examples(SourceConfig(path=str(tmp_path / name)))
    # a .json file that is one broken pretty-printed document: the error's own line, not a line-1 record
    (tmp_path / "broken.json").write_text('{\n  "messages": [\n    {"role": "user",, "content": "a"}\n  ]\n}\n')
    with pytest.raises(ValueError, match=r"broken.json:3: not valid JSON .*pretty-printed JSON document cannot be "
                                         "skipped record by record"):
        examples(SourceConfig(path=str(tmp_path / "broken.json")))
    # only when it looks like one: a first line broken off, or `{` alone before an unindented line, stay records
    (tmp_path / "lines.jsonl").write_text('{\n{"messages": []}\n')
    got = examples(SourceConfig(path=str(tmp_path / "lines.jsonl")))
    assert [e.reason for e in got] == ["malformed_json", "empty_conversation"]


def test_prompt_completion_keeps_its_tools(tmp_path):
    """TRL's conversational prompt-completion with a `tools` column (hubertmarek/mistral-large-agent-diff-sft: prompt
    and completion lists, the completion's tool_calls, tools a JSON string; Salesforce/xlam-function-calling-60k's
    query/answers/tools mapped onto prompt/completion) lost its tools without a word: the call trained without the
    definition of the function it calls."""
    spec = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = {"function": {"arguments": '{"city": "Paris"}', "name": "get_weather"}, "id": "call_1", "index": 0,
            "type": "function"}
    (tmp_path / "agent.jsonl").write_text(json.dumps({
        "prompt": [{"role": "user", "content": "Weather in Paris?"}],
        "completion": [{"role": "assistant", "content": "", "tool_calls": [call]}],
        "tools": json.dumps([spec])}) + "\n")
    got = examples(SourceConfig(path=str(tmp_path / "agent.jsonl")))[0]
    assert isinstance(got, Example), str(got)
    assert got.tools == [spec]
    assert got.messages[-1]["tool_calls"] == [call]
    (tmp_path / "xlam.jsonl").write_text(json.dumps({
        "id": 1, "query": "Weather in Paris?", "answers": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "tools": json.dumps([spec["function"]])}) + "\n")
    got = examples(SourceConfig(path=str(tmp_path / "xlam.jsonl"), format="prompt_completion",
                                columns={"prompt": "query", "completion": "answers"}))[0]
    assert got.tools == [spec["function"]]
    # mapped, as the other formats' tools
    (tmp_path / "mapped.jsonl").write_text(json.dumps({"prompt": "q", "completion": "a",
                                                       "functions_json": json.dumps([spec])}) + "\n")
    got = examples(SourceConfig(path=str(tmp_path / "mapped.jsonl"), format="prompt_completion",
                                columns={"tools": "functions_json"}))[0]
    assert got.tools == [spec]


def test_openassistant_message_table_is_not_read_as_text(tmp_path):
    """OpenAssistant/oasst1's Hub table (its parquet, and 2023-04-12_oasst_ready.messages.jsonl.gz): one message a row,
    with a `text` column, was auto-detected as format text: every prompt and answer trained as a document of its own,
    deleted and rejected messages too. It names the trees file instead; format oasst says the same per row."""
    def message(mid, parent, role, text, rank):
        return {"message_id": mid, "parent_id": parent, "user_id": "u", "created_date": "2023-02-05T14:23:50+00:00",
                "text": text, "role": role, "lang": "en", "review_count": 3, "review_result": True, "deleted": False,
                "rank": rank, "synthetic": False, "model_name": None, "detoxify": None, "message_tree_id": "m1",
                "tree_state": "ready_for_export", "emojis": None, "labels": None}
    path = tmp_path / "oasst1.jsonl"
    path.write_text(json.dumps(message("m1", None, "prompter", "What is a monad?", None)) + "\n"
                    + json.dumps(message("m2", "m1", "assistant", "A design pattern.", 0)) + "\n")
    with pytest.raises(ValueError, match=r"oasst1.jsonl:1: OpenAssistant's message table \(one message a row, "
                                         r"linked by parent_id\).*trees\.jsonl\.gz"):
        examples(SourceConfig(path=str(path)))
    got = examples(SourceConfig(path=str(path), format="oasst"))
    assert all(isinstance(e, RecordError) and "trees.jsonl.gz" in str(e) for e in got), [str(e) for e in got]
    # a text column beside a tree id alone (TinyPixel/oasst1: whole conversations as text) is still text
    (tmp_path / "flat.jsonl").write_text(json.dumps({"message_tree_id": "m1", "text": "### Human: hi"}) + "\n")
    assert examples(SourceConfig(path=str(tmp_path / "flat.jsonl")))[0].text == "### Human: hi"


def test_tool_schemas_of_a_parquet_file_keep_only_their_own_parameters(tmp_path):
    """Tools stored as Arrow structs (datasets' push_to_hub of a list of dicts: kaizen9/ddqa, NemoSheng/web_search)
    share one struct type, so every tool has every other tool's parameters, null where it had none: get_weather
    trained as taking `query` and `limit` too. A null is no JSON schema, so those keys are absent ones; a
    `default: null` (a value, not a schema) stays."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    weather = {"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "City"}}, "required": ["city"]}}}
    search = {"type": "function", "function": {"name": "search", "description": "Search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "description": "Query"},
                                         "limit": {"type": "integer", "description": "Max"}},
        "required": ["query"]}}}
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = [{"messages": chat, "tools": [weather]}, {"messages": chat, "tools": [search]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "tools.parquet")
    got = examples(SourceConfig(path=str(tmp_path / "tools.parquet")))
    assert all(isinstance(e, Example) for e in got), [str(e) for e in got]
    assert [e.tools for e in got] == [[weather], [search]]
    # values stay: a default or const of null, an enum's null, the literal objects of examples
    unit = {"type": ["string", "null"], "enum": ["C", "F", None], "default": None, "examples": [{"a": None}]}
    spec = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"unit": unit}}}}
    # ... but a parameter named as one of those keywords is a parameter, dropped when null
    padded = json.loads(json.dumps(spec))
    padded["function"]["parameters"]["properties"]["default"] = None
    (tmp_path / "nullable.jsonl").write_text(json.dumps({"messages": chat, "tools": [padded]}) + "\n")
    assert examples(SourceConfig(path=str(tmp_path / "nullable.jsonl")))[0].tools == [spec]


def test_unpaired_preference_rows_labelled_false_are_not_trained(tmp_path):
    """TRL's unpaired preference (KTO) rows, trl-lib/kto-mix-14k: prompt, completion and a bool `label`, false for a
    completion not to learn. Read as prompt-completion, the bad completions trained as well as the good ones; they are
    left out and counted (as a rejected OpenAssistant message is), under either on_error."""
    prompt = [{"content": "What color is the sky?", "role": "user"}]
    rows = [{"prompt": prompt, "completion": [{"content": "Blue.", "role": "assistant"}], "label": True},
            {"prompt": prompt, "completion": [{"content": "Made of cheese.", "role": "assistant"}], "label": False}]
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = examples(SourceConfig(path=str(tmp_path / "kto.jsonl")))
    assert isinstance(got[0], Example) and got[0].messages[-1]["content"] == "Blue."
    assert isinstance(got[1], Skipped) and got[1].reason == "undesirable_completion"
    assert str(got[1]).startswith(f"{tmp_path / 'kto.jsonl'}:2: label: ")


def test_unpaired_preference_labels_as_text_in_a_csv(tmp_path):
    """A CSV of KTO rows (pandas' to_csv of trl-lib/kto-mix-14k's prompt, completion, label) holds each label as the
    text "True"/"False": only a real false was left out, so every completion labelled "False" trained. Text labels
    read as the bools they write; a label that is neither (a class name, an empty cell) is not KTO's: the row trains."""
    rows = [("Sky?", "Blue.", "True"), ("Sky?", "Cheese.", "False"), ("Sea?", "Wet.", "true"),
            ("Sea?", "Dry.", "false"), ("Sun?", "Hot.", "maybe"), ("Sun?", "Cold.", "")]
    with open(tmp_path / "kto.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion", "label"])
        w.writerows(rows)
    got = examples(SourceConfig(path=str(tmp_path / "kto.csv")))
    assert [e.messages[-1]["content"] for e in got if isinstance(e, Example)] == ["Blue.", "Wet.", "Hot.", "Cold."]
    assert [(e.where.rsplit(":", 1)[1], e.reason) for e in got if isinstance(e, RecordError)] == [
        ("3", "undesirable_completion"), ("5", "undesirable_completion")]


def test_paired_preference_data_says_how_to_train_its_chosen_answers(tmp_path):
    """DPO data (TRL's preference type: prompt, chosen, rejected; Intel/orca_dpo_pairs' system, question, chosen,
    rejected; Anthropic/hh-rlhf's chosen and rejected transcripts) stopped with the generic "cannot tell the format"
    and an example mapping of question/answer columns it does not have; it names the preference pair and the mapping
    that trains the chosen answers, and the error lists the fields each format is detected by."""
    rows = {"dpo.jsonl": {"prompt": [{"role": "user", "content": "Sky?"}], "chosen": [{"role": "assistant",
            "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Green."}]},
            "hh.jsonl": {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello", "rejected": "\n\nHuman: Hi\n\nAssistant: Go"},
            "orca.jsonl": {"system": "", "question": "Sky?", "chosen": "Blue.", "rejected": "Green."},
            # mlabonne/orpo-dpo-mix-40k: the pair are whole conversations, the prompt column their first turn again
            "orpo.jsonl": {"source": "x", "prompt": "Sky?", "question": "Sky?",
                           "chosen": [{"content": "Sky?", "role": "user"}, {"content": "Blue.", "role": "assistant"}],
                           "rejected": [{"content": "Sky?", "role": "user"}, {"content": "Red.", "role": "assistant"}]}}
    for name, row in rows.items():
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"dpo.jsonl:1: .*preference pair \(chosen, rejected\).*"
                                         r"\{format: prompt_completion, columns: \{completion: chosen\}\}"):
        examples(SourceConfig(path=str(tmp_path / "dpo.jsonl")))
    with pytest.raises(ValueError, match=r"hh.jsonl:1: .*preference pair.*\{format: text, columns: \{text: chosen\}\}"):
        examples(SourceConfig(path=str(tmp_path / "hh.jsonl")))
    with pytest.raises(ValueError, match=r"orca.jsonl:1: .*preference pair.*\{format: prompt_completion, columns: "
                                         r"\{prompt: COLUMN, completion: chosen\}\}, COLUMN the one that holds"):
        examples(SourceConfig(path=str(tmp_path / "orca.jsonl")))
    with pytest.raises(ValueError, match=r"orpo.jsonl:1: .*\{format: messages, columns: \{messages: chosen\}\}"):
        examples(SourceConfig(path=str(tmp_path / "orpo.jsonl")))
    with pytest.raises(ValueError, match=r"looked for messages \(messages\), conversations or conversation "
                                         r"\(sharegpt\), instruction \(alpaca\), prompt and completion"):
        examples(SourceConfig(path=str(tmp_path / "hh.jsonl")))
    # the mapping it names reads the chosen answers
    got = examples(SourceConfig(path=str(tmp_path / "dpo.jsonl"), format="prompt_completion",
                                columns={"completion": "chosen"}))
    assert got[0].messages == [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}]


# LDJnr/Capybara's rows (CapybaraPure_Decontaminated.jsonl; LDJnr/Pure-Dove's are alike): a source and a
# conversation of {input, output} pairs, each one user turn and the assistant's answer to it
CAPYBARA = [{"source": "Know-Logic", "conversation": [
    {"input": "What is the capital of France?", "output": "The capital of France is Paris."},
    {"input": "And its population?", "output": "About 2.1 million people live in Paris proper."}]},
    {"source": "Dove", "conversation": [{"input": "Write a haiku about rain.", "output": "Soft rain on the roof"}]}]
CAPYBARA_MESSAGES = [[{"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "The capital of France is Paris."},
                      {"role": "user", "content": "And its population?"},
                      {"role": "assistant", "content": "About 2.1 million people live in Paris proper."}],
                     [{"role": "user", "content": "Write a haiku about rain."},
                      {"role": "assistant", "content": "Soft rain on the roof"}]]


def test_capybara_conversations_of_input_output_pairs(tmp_path):
    """LDJnr/Capybara and LDJnr/Pure-Dove ({"source", "conversation": [{"input", "output"}, ...]}) were detected as
    ShareGPT and every record refused (its turns have no role), and no columns mapping could read a pair as two
    turns. Each pair is a user turn and its answer, auto-detected in JSON lines, the Hub's Parquet and a CSV's JSON
    string, and under `conversations` (machine-translated copies, e.g. trajkovnikola/Capybara-mk)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "capybara.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CAPYBARA))
    pq.write_table(pa.Table.from_pylist(CAPYBARA), tmp_path / "capybara.parquet")
    with open(tmp_path / "capybara.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "conversation"])
        w.writerows([r["source"], json.dumps(r["conversation"])] for r in CAPYBARA)
    (tmp_path / "mk.jsonl").write_text("".join(json.dumps({"conversations": r["conversation"]}) + "\n"
                                               for r in CAPYBARA))
    for name in ("capybara.jsonl", "capybara.parquet", "capybara.csv", "mk.jsonl"):
        got = examples(SourceConfig(path=str(tmp_path / name)))
        assert [e.messages for e in got] == CAPYBARA_MESSAGES, name
    assert [e.messages for e in examples(SourceConfig(path=str(tmp_path / "capybara.jsonl"), format="capybara"))] \
        == CAPYBARA_MESSAGES
    # other names for the pair's keys, through columns
    renamed = [{"dialog": [{"q": p["input"], "a": p["output"]} for p in r["conversation"]]} for r in CAPYBARA]
    (tmp_path / "renamed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    got = examples(SourceConfig(path=str(tmp_path / "renamed.jsonl"), format="capybara",
                                columns={"conversation": "dialog", "input": "q", "output": "a"}))
    assert [e.messages for e in got] == CAPYBARA_MESSAGES
    # a bad pair names its field; read as ShareGPT, a pair says which format reads it
    bad = [{"conversation": [{"input": "Hi", "output": "Hello"}, {"input": "More?"}]},
           {"conversation": [{"input": "Hi", "output": "Hello"}, "Thanks"]},
           {"conversation": [{"input": "Hi", "output": ["Hello"]}]}, {"conversation": []}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    got = examples(SourceConfig(path=str(tmp_path / "bad.jsonl")))
    assert [(e.field, e.reason) for e in got] == [
        ("conversation[1].output", "missing_field"), ("conversation[1]", "bad_value"),
        ("conversation[0].output", "bad_value"), ("conversation", "empty_conversation")]
    assert str(got[0]) == f"{tmp_path / 'bad.jsonl'}:1: conversation[1].output: missing; the turn has ['input']"
    got = examples(SourceConfig(path=str(tmp_path / "capybara.jsonl"), format="sharegpt"))
    assert str(got[0]).endswith("conversation[0].from: missing; the turn has ['input', 'output']; {input, output} "
                                "pairs (LDJnr/Capybara's) are format capybara")


# glaiveai/glaive-function-calling-v2 (its one file, glaive-function-calling-v2.json, a JSON array of {system, chat}):
# the system text's lead-in, then each function definition as json.dumps(indent=4) writes it, apart by blank lines
GLAIVE_LEAD_IN = "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
DETECT = {"name": "detect_language", "description": "Detect the language of a given text",
          "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "The text"}},
                         "required": ["text"]}}
SMS = {"name": "send_sms", "description": "Send an SMS", "parameters": {"type": "object", "properties": {
    "phone_number": {"type": "string"}, "message": {"type": "string"}}, "required": ["phone_number", "message"]}}
TIME = {"name": "get_current_time", "description": "Get the current time", "parameters": {}}
NO_FUNCTIONS = "SYSTEM: You are a helpful assistant, with no access to external functions.\n\n"


def glaive_system(*functions) -> str:
    return GLAIVE_LEAD_IN + "".join(json.dumps(f, indent=4) + "\n\n" for f in functions)


def glaive_chat(*turns) -> str:
    return "\n\n\n".join(turns) + "\n\n\n"


def call(name: str, arguments: str) -> str:
    return f'ASSISTANT: <functioncall> {{"name": "{name}", "arguments": {arguments}}} <|endoftext|>'


def tool_call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


GLAIVE_ROWS = [
    # two functions; a question back, a call with single-quoted arguments, its response and the answer; a second call
    # whose quoted arguments are pretty-printed and hold an apostrophe, left unanswered at the chat's end
    {"system": glaive_system(DETECT, SMS), "chat": glaive_chat(
        "USER: I have a text here. Can you tell me what language it is?",
        "ASSISTANT: Of course. Please provide me with the text. <|endoftext|>",
        'USER: Here it is - "Je suis un étudiant"',
        call("detect_language", '\'{"text": "Je suis un étudiant"}\''),
        'FUNCTION RESPONSE: {"language": "French"}',
        "ASSISTANT: The text you provided is in French. <|endoftext|>",
        "USER: Thanks! Text my friend at 1234567890 that we meet at 6.",
        call("send_sms", '\'{\n  "phone_number": "1234567890",\n  "message": "Hey, let\'s meet at 6"\n}\'')),
     "messages": [{"role": "user", "content": "I have a text here. Can you tell me what language it is?"},
                  {"role": "assistant", "content": "Of course. Please provide me with the text."},
                  {"role": "user", "content": 'Here it is - "Je suis un étudiant"'},
                  {"role": "assistant", "content": None,
                   "tool_calls": [tool_call("detect_language", {"text": "Je suis un étudiant"})]},
                  {"role": "tool", "content": '{"language": "French"}'},
                  {"role": "assistant", "content": "The text you provided is in French."},
                  {"role": "user", "content": "Thanks! Text my friend at 1234567890 that we meet at 6."},
                  {"role": "assistant", "content": None, "tool_calls": [tool_call(
                      "send_sms", {"phone_number": "1234567890", "message": "Hey, let's meet at 6"})]}],
     "tools": [{"type": "function", "function": DETECT}, {"type": "function", "function": SMS}]},
    # no functions: the system text stays the system message; these rows' turns are apart by "\n\n"
    {"system": NO_FUNCTIONS, "chat": "USER: Assign this occupation to a category\nNurse\n\nASSISTANT: Healthcare "
                                     "<|endoftext|>\n\nUSER: What about an electrician?\n\nASSISTANT: Skilled Trades "
                                     "<|endoftext|>",
     "messages": [{"role": "system", "content": "You are a helpful assistant, with no access to external functions."},
                  {"role": "user", "content": "Assign this occupation to a category\nNurse"},
                  {"role": "assistant", "content": "Healthcare"},
                  {"role": "user", "content": "What about an electrician?"},
                  {"role": "assistant", "content": "Skilled Trades"}],
     "tools": None},
    # words before the call are its turn's text; arguments as an object, as a quoted string with the Python escape
    # \' (not JSON's), and none at all (a function of no parameters)
    {"system": glaive_system(SMS, TIME), "chat": glaive_chat(
        "USER: What time is it?",
        'ASSISTANT: Let me check.\n<functioncall> {"name": "get_current_time", "arguments": {}} <|endoftext|>',
        'FUNCTION RESPONSE: {"time": "10:30 AM"}',
        "ASSISTANT: It is 10:30 AM. <|endoftext|>",
        "USER: Text 555 that I'm late.",
        call("send_sms", '\'{"phone_number": "555", "message": "I\\\'m late"}\''),
        'FUNCTION RESPONSE: {"status": "sent"}',
        'ASSISTANT: <functioncall> {"name": "get_current_time"} <|endoftext|>'),
     "messages": [{"role": "user", "content": "What time is it?"},
                  {"role": "assistant", "content": "Let me check.", "tool_calls": [tool_call("get_current_time", {})]},
                  {"role": "tool", "content": '{"time": "10:30 AM"}'},
                  {"role": "assistant", "content": "It is 10:30 AM."},
                  {"role": "user", "content": "Text 555 that I'm late."},
                  {"role": "assistant", "content": None,
                   "tool_calls": [tool_call("send_sms", {"phone_number": "555", "message": "I'm late"})]},
                  {"role": "tool", "content": '{"status": "sent"}'},
                  {"role": "assistant", "content": None, "tool_calls": [tool_call("get_current_time", {})]}],
     "tools": [{"type": "function", "function": SMS}, {"type": "function", "function": TIME}]},
]
# rows that cannot be read, each with its field, reason and what the error says was unexpected
GLAIVE_BAD = [
    ({"system": glaive_system(SMS), "chat": glaive_chat("USER: Text 555 hi", call("send_message", "'{}'"))},
     "bad_value", "turn 2 (ASSISTANT): a call to 'send_message', which the system text does not define (it defines "
                  "send_sms)"),
    ({"system": NO_FUNCTIONS, "chat": glaive_chat("USER: Time?", call("get_current_time", "'{}'"))},
     "bad_value", "turn 2 (ASSISTANT): a call to 'get_current_time', which the system text does not define (it "
                  "defines no functions)"),
    # the call in another syntax: the response answers no <functioncall>
    ({"system": glaive_system(TIME), "chat": glaive_chat(
        "USER: Time?", 'ASSISTANT: Sure.\nAI to= get_current_time: {} <|endoftext|>', 'FUNCTION RESPONSE: {"t": 1}')},
     "bad_value", "turn 3 (FUNCTION RESPONSE): a function response to no call"),
    # a turn marker lost inside a user turn: its text runs on into an answer
    ({"system": NO_FUNCTIONS, "chat": glaive_chat(
        'USER: Add the book "\nASSISTANT: A Modern Approach" to my cart. <|endoftext|>',
        "ASSISTANT: Done. <|endoftext|>")},
     "bad_value", "turn 1 (USER): <|endoftext|> inside the turn, not at an answer's end"),
    ({"system": glaive_system(SMS), "chat": glaive_chat("USER: hi", call("send_sms", "'{\"message\": [User data]}'"))},
     "malformed_json", "turn 2 (ASSISTANT): the call is not JSON (Expecting value)"),
    ({"system": glaive_system(SMS), "chat": glaive_chat("USER: hi", call("send_sms", "'[5, 10]'"))},
     "bad_value", "turn 2 (ASSISTANT): the call's arguments are not a JSON object"),
    ({"system": glaive_system(SMS), "chat": glaive_chat("USER: hi", call("send_sms", "'{\"n\": Infinity}'"))},
     "malformed_json", "turn 2 (ASSISTANT): the call is not JSON (Infinity is not JSON)"),
    ({"system": glaive_system(TIME), "chat": glaive_chat(
        "USER: hi", 'ASSISTANT: <functioncall> {"name": "get_current_time", "parameters": {}} <|endoftext|>')},
     "bad_value", "turn 2 (ASSISTANT): expected <functioncall> {\"name\": ..., \"arguments\": ...}"),
    # the call stops inside its arguments
    ({"system": glaive_system(SMS), "chat": glaive_chat(
        "USER: hi", 'ASSISTANT: <functioncall> {"name": "send_sms", "arguments": \'{"message": "')},
     "malformed_json", "turn 2 (ASSISTANT): the call is not JSON"),
    ({"system": GLAIVE_LEAD_IN + '{\n    "name": "f",\n    "description": "broken\n}\n', "chat": "USER: hi"},
     "malformed_json", "function definition 1 after the lead-in is not valid JSON"),
    ({"system": NO_FUNCTIONS, "chat": "Hello there\n\n\nASSISTANT: hi <|endoftext|>"},
     "bad_value", "expected a turn marker (USER:, ASSISTANT:, FUNCTION RESPONSE:) at the start, got 'Hello there"),
]


def test_glaive_function_calling_v2_reads_as_tools_calls_and_results(tmp_path):
    """glaive-function-calling-v2's {system, chat} rows were refused as of no known format, and the one mapping that
    read them, format text of the chat, trained every token (the user's turns and the function responses too, the
    call as glaive's own syntax, no tools). The function definitions are the tools,
    each <functioncall> an assistant tool call (its single-quoted arguments parsed), each FUNCTION RESPONSE the
    call's result, every <|endoftext|> gone; auto-detected, in the dataset's JSON array and its Hub Parquet."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"system": r["system"], "chat": r["chat"]} for r in GLAIVE_ROWS]
    (tmp_path / "glaive-function-calling-v2.json").write_text(json.dumps(rows, indent=4))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    for name in ("glaive-function-calling-v2.json", "train.parquet"):
        got = examples(SourceConfig(path=str(tmp_path / name)))
        assert all(isinstance(e, Example) for e in got), [str(e) for e in got]
        assert [e.messages for e in got] == [r["messages"] for r in GLAIVE_ROWS], name
        assert [e.tools for e in got] == [r["tools"] for r in GLAIVE_ROWS], name
    got = examples(SourceConfig(path=str(tmp_path / "train.parquet"), format="glaive"))
    assert [e.messages for e in got] == [r["messages"] for r in GLAIVE_ROWS]

    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(row) + "\n" for row, _, _ in GLAIVE_BAD))
    got = examples(SourceConfig(path=str(tmp_path / "bad.jsonl"), format="glaive"))
    assert all(isinstance(e, RecordError) and not isinstance(e, Skipped) for e in got)
    for n, (e, (row, reason, says)) in enumerate(zip(got, GLAIVE_BAD), 1):
        field = "system" if says.startswith("function definition") else "chat"
        assert (e.where, e.field, e.reason) == (f"{tmp_path / 'bad.jsonl'}:{n}", field, reason), str(e)
        assert str(e).startswith(f"{e.where}: {field}: {says}"), str(e)
