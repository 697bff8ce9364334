"""Readers: the files users have -> `Example` records (a conversation in messages form, or plain text).

Formats (SourceConfig.format, canonical fields in config.DATA_FORMAT_FIELDS, renamed by `columns`; a field marked ?
mapped to null there is not read):
  messages           {"messages": [{"role", "content"}, ...], "tools"?}
  sharegpt           {"conversations": [{"from", "value"}, ...], "tools"?, "system"?}; roles mapped
                     (`conversation` too; unmapped, either format's turns may be {"role", "content"} or
                     {"from", "value"})
  alpaca             {"instruction", "input"? (or "context"), "output" (or "response"), "system"?, "history"?};
                     Self-Instruct's rows, with "instances": [{"input", "output"}, ...] and no "output", give one
                     example per instance (where: `file:N instance K`; data.eval_fraction holds a row's out together)
  prompt_completion  {"prompt", "completion", "system"?, "tools"?}; a row of TRL's unpaired preference (KTO) data
                     with `"label": false` (a completion not to learn) is left out, counted as undesirable_completion;
                     the label may be text, a CSV's "True"/"false" (a label of any other value is not KTO's:
                     the row trains)
  capybara           {"conversation": [{"input", "output"}, ...]} (LDJnr/Capybara, LDJnr/Pure-Dove; `conversations`
                     too): each pair a user turn (input) and the assistant's answer (output)
  glaive             glaiveai/glaive-function-calling-v2's {"system", "chat"}: the chat one string of turns, "USER: ",
                     "ASSISTANT: " (its end marked <|endoftext|>) and "FUNCTION RESPONSE: ", apart by blank lines; an
                     assistant's `<functioncall> {"name", "arguments": '{...}'}` is a tool call, the response after it
                     the tool's result, the JSON function definitions after the system text's lead-in the tools (the
                     lead-in itself is left to the template's tool prompt). A turn that does not read so (a response
                     to no call, arguments that are not a JSON object, a call to an undefined function, a turn
                     marker lost inside another turn) is a bad record naming the turn
  text               {"text"} for continued pre-training
  segments           template-free text in pieces, {"segments": [{"label": bool, "text": str}, ...]} (Axolotl's
                     input_output type): each piece's text tokenized on its own (special tokens written in it read
                     as such) and the pieces' tokens concatenated, nothing added (no bos, eos nor chat template);
                     the tokens of a piece of label true are trained (all of them under data.train_on: all)
  oasst              OpenAssistant's message trees, {"message_tree_id", "prompt": {"role", "text", "replies": [...]}}:
                     every root-to-leaf thread is an example (where: `file:N thread K`; threads of one tree share
                     their prefixes, so data.eval_fraction holds a tree's threads out together, Example.group),
                     prompter -> user. A message with `deleted: true` or `review_result: false` is left out with its
                     replies; a thread ends at its last assistant turn, and one with none (an unanswered prompt) is
                     dropped and counted as no_assistant_turn, under either on_error; so is a thread that, so cut,
                     repeats another of its tree (an answer's several unanswered follow-ups), as duplicate_thread.
                     The dataset's message table (one message a row: the Hub's parquet, .messages.jsonl.gz) is
                     refused, naming the .trees.jsonl.gz file (its `text` column is not format text)
  oasst_top1         the same trees, one thread each: at every step the reply of lowest `rank` (0 = the best; unranked
                     replies after ranked ones, in order), as OpenAssistant's oasst_top1 datasets. Auto detection
                     gives oasst (all threads); set format: oasst_top1 for the top-ranked path only
A turn's content may be a string or OpenAI's text parts; prompt_completion's prompt and completion may be
lists of turns (TRL's conversational prompt-completion). An assistant turn may carry OpenAI's `weight`: 0 leaves it
out of the loss (data.train_on: assistant, last_assistant), 1 is the default. OpenAI's legacy function calling (an
assistant `function_call`, role `function`, top-level `functions`) reads as tool_calls, role tool and tools. A tool
definition's null keys are absent ones (Arrow pads each tool of a column with the others' parameters, null).
Files: .jsonl/.ndjson, .json (an array, or one object per line), .parquet, .csv, .arrow, and those JSON ones gzip'ed
(.jsonl.gz); globs;
folders of such files (not one that holds a dataset's splits, train.jsonl beside test.jsonl: an error that says to
point at the training files); folders written by datasets' `save_to_disk`.

A bad record is never dropped here: it comes out as a `RecordError` naming the file, the line
(or row) and the field, and the caller raises it or counts it by `reason`, as the config says. What the format
itself leaves out (an OpenAssistant thread without an answer) comes out as a `Skipped`, always counted, never raised.
"""
from __future__ import annotations

import csv
import glob
import gzip
import itertools
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gapless.config import SourceConfig

# Role names a file may use, mapped onto config.CHAT_ROLES; SourceConfig.roles adds to or overrides them.
DEFAULT_ROLES = {
    "system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
    "human": "user", "gpt": "assistant", "function_call": "tool_call", "observation": "tool",
    # OpenAI's: `developer` is the system role of its newer models, `function` the tool result of its legacy functions
    "developer": "system", "function": "tool",
}
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
            ".csv": "csv", ".arrow": "arrow"}
# gzip'ed JSON (`train.jsonl.gz`, as many hub datasets ship it) is read as it streams
GZIPPED = (".jsonl.gz", ".ndjson.gz", ".json.gz")
# The reasons a record is skipped under on_error: skip (the summary counts each).
MALFORMED_JSON, MISSING_FIELD, BAD_VALUE, UNKNOWN_ROLE, EMPTY_CONVERSATION = (
    "malformed_json", "missing_field", "bad_value", "unknown_role", "empty_conversation")
NOT_UTF8, TOO_LARGE = "not_utf8", "too_large"
NO_ASSISTANT_TURN = "no_assistant_turn"  # a Skipped OpenAssistant thread
# a Skipped row of TRL's unpaired preference (KTO) data: prompt, completion, `label: false` (a completion not to learn)
UNDESIRABLE_COMPLETION = "undesirable_completion"
# a Skipped OpenAssistant thread that, cut to its last assistant turn, is another thread of its tree: an answer with
# several unanswered follow-ups gives one leaf each and the same cut thread each (62 of the 626 threads of
# ../shared/data/raw/oasst_en100), which would train that answer once per follow-up
DUPLICATE_THREAD = "duplicate_thread"
# The largest record read, in bytes of its line (JSON lines) or characters of its text (every format). Memory
# and time grow with a record's size, not only its tokens: a 20 MB single-line record took 63 s and 9.2 GB to
# tokenize (the tokenizer's offsets, ~460 bytes per character), and truncation to max_seq_len comes after it.
# 4 MiB is ~1M Llama-3 tokens, 256 times the default max_seq_len; a longer text belongs in several records.
MAX_RECORD_BYTES = 1 << 22


class RecordError(ValueError):
    """One bad input record: `where` is file:line (or `file row N`), `reason` one of the constants above."""

    def __init__(self, where: str, field: str | None, reason: str, problem: str):
        self.where, self.field, self.reason, self.problem = where, field, reason, problem
        super().__init__(f"{where}: {field}: {problem}" if field else f"{where}: {problem}")

    def __reduce__(self):  # pickled across tokenizer worker processes
        return type(self), (self.where, self.field, self.reason, self.problem)


class Skipped(RecordError):
    """A record the format itself leaves out, not a mistake in the file (an OpenAssistant thread with no assistant
    turn: an unanswered prompt is an ordinary part of a tree): counted as dropped by `reason` under either on_error."""


@dataclass
class Example:
    where: str  # file:line or `file row N`, for messages about this record
    messages: list[dict] | None = None  # [{"role", "content", ...}], roles in user/assistant/system/tool
    tools: list | None = None  # tool definitions (JSON schema dicts) for the chat template
    text: str | None = None  # plain text (format text)
    segments: list[tuple[str, bool]] | None = None  # (text, trained) pieces, concatenated (format segments)
    # records of one group are held out together by data.eval_fraction (pipeline.split_eval): the threads of an
    # OpenAssistant tree, which share its prompt and earlier turns, and the instances of a Self-Instruct row, which
    # share its instruction. None: a record of its own. Unique within a source
    group: str | None = None


# ---------------------------------------------------------------------------------------------
# files


def resolve_files(path: str) -> list[Path]:
    """A file, a glob, a folder of data files, or a datasets save_to_disk folder -> the data files."""
    expanded = str(Path(path).expanduser())
    if glob.has_magic(expanded):
        matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True))
        if not matches:
            raise ValueError(f"{path}: no files match this pattern")
        return [f for m in matches for f in _expand(m, path)]
    p = Path(expanded)
    if not p.exists():
        raise ValueError(f"{path}: no such file or folder")
    return _expand(p, path)


def _expand(p: Path, given: str) -> list[Path]:
    if p.is_file():
        if _kind(p) is None:
            raise ValueError(f"{p}: unsupported file type {p.suffix!r}; use one of {sorted(SUFFIXES) + list(GZIPPED)}"
                             + (" (decompress it first)" if p.suffix.lower() in (".gz", ".zst", ".bz2", ".xz", ".zip")
                                else ""))
        return [p]
    if (p / "state.json").is_file():  # datasets.Dataset.save_to_disk: Arrow stream shards listed in state.json
        state = json.loads((p / "state.json").read_text())
        return [p / f["filename"] for f in state.get("_data_files", [])]
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{given}: a DatasetDict folder with splits {splits}; point the path at one, "
                         f"e.g. {p / (splits[0] if splits else 'train')}")
    files = sorted(f for f in p.iterdir() if f.is_file() and _kind(f) is not None)
    if not files:
        inner = sorted(f.name for f in (p / "data").glob("*") if f.is_file() and _kind(f) is not None) \
            if (p / "data").is_dir() else []
        raise ValueError(f"{given}: folder has no {'/'.join(sorted(SUFFIXES))} files"
                         + (f"; its data/ folder (a Hub dataset's layout) has {len(inner)}, e.g. {inner[0]}: point "
                            f"the path at them" if inner else ""))
    splits = folder_splits(files)
    if len(splits) > 1:  # train.jsonl beside test.jsonl: reading the folder would train on the held-out split
        held = "; ".join(f"{split}: {', '.join(f.name for f in found)}" for split, found in splits.items())
        train = splits.get("train")
        hint = (f"point the path at the training files ({p / train[0].name if len(train) == 1 else p / 'train*'})"
                " and give the others as data.eval_sources" if train else
                "point the path at the files to train on")
        raise ValueError(f"{given}: folder holds the splits of a dataset ({held}); {hint}")
    return files


# the split names `datasets` infers from file names (its data_files patterns: a keyword, then a separator, a digit or
# the suffix), by split: train.jsonl, test-00000-of-00001.parquet, validation_v2.json
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
                  "test": ("test", "testing", "eval", "evaluation")}
SPLIT_NAME = re.compile(r"^(" + "|".join(k for keys in SPLIT_KEYWORDS.values() for k in keys) + r")(?=[-_. 0-9])",
                        re.IGNORECASE)


def folder_splits(files: list[Path]) -> dict[str, list[Path]]:
    """The data files of `files` named as a dataset's splits, by split (in the order "train", "validation", "test"),
    each split's in file order; other files, and files named otherwise, are in no split."""
    splits: dict[str, list[Path]] = {}
    for f in files:
        m = SPLIT_NAME.match(f.name)
        if m and f.is_file() and _kind(f) is not None:
            split = next(s for s, keys in SPLIT_KEYWORDS.items() if m[1].lower() in keys)
            splits.setdefault(split, []).append(f)
    return {split: splits[split] for split in SPLIT_KEYWORDS if split in splits}


def _kind(file: Path) -> str | None:
    """jsonl, json, parquet, csv or arrow, from the file's name (gzip'ed JSON by its inner suffix); None: not data."""
    name = file.name.lower()
    if name.endswith(GZIPPED):
        return SUFFIXES[Path(name[:-3]).suffix]
    return SUFFIXES.get(file.suffix.lower())


def read_rows(file: Path) -> Iterator[tuple[str, dict | RecordError]]:
    """(where, row) for each record of a file; a row that is not a JSON object comes as a RecordError."""
    kind = _kind(file)
    if file.name.lower().endswith(".gz"):
        try:
            with gzip.open(file, "rb") as f:
                yield from (_jsonl_rows(file, _bounded_lines(file, f)) if kind == "jsonl" else _json_rows(file))
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # the rows after the damage are lost
            raise ValueError(f"{file}: not a readable gzip file ({e}); re-download or re-compress it") from None
    elif kind == "jsonl":
        with open(file, "rb") as f:  # lines end at \n only: str.splitlines would also split
            _refuse_binary(file, f.read(8192))  # at U+2028 and friends, which JSON strings may hold raw
            f.seek(0)
            yield from _jsonl_rows(file, _bounded_lines(file, f))
    elif kind == "json":
        yield from _json_rows(file)
    elif kind == "csv":
        yield from _csv_rows(file)
    else:
        yield from _arrow_rows(file, kind)


def _refuse_binary(file: Path, head: bytes) -> None:
    """A NUL byte is never in a text file (JSON escapes it as \\u0000): the file is binary, not skippable."""
    at = head.find(b"\0")
    if at >= 0:
        raise ValueError(f"{file}: a binary file (a NUL byte at byte {at}), not "
                         f"{_kind(file)} text; point the source at the data files")


def _bounded_lines(file: Path, f) -> Iterator[str | RecordError]:
    """Each line of a binary file as text, or as the RecordError of a line that is not UTF-8 or is larger
    than MAX_RECORD_BYTES (read past in 1 MiB pieces: memory stays bounded)."""
    n = 0
    while line := f.readline(MAX_RECORD_BYTES + 1):
        n += 1
        if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
            size = len(line)
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                size += len(rest)
            size += len(rest)
            yield RecordError(f"{file}:{n}", None, TOO_LARGE, f"a record of {size:,} bytes, over the limit of "
                              f"{MAX_RECORD_BYTES:,} (gapless.data.formats.MAX_RECORD_BYTES); split it into records")
            continue
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield RecordError(f"{file}:{n}", None, NOT_UTF8, f"not UTF-8 text (byte 0x{line[e.start]:02x} at "
                              f"column {e.start + 1}); re-encode the file as UTF-8")


def _pretty_printed(first: Any, second: Any) -> bool:
    """Line 1 is `{` or `[` alone and line 2 is indented: JSON written with indent (json.dump(indent=2), jq .),
    which no line of JSON lines looks like."""
    return (isinstance(first, str) and isinstance(second, str) and first.removeprefix("\ufeff").strip() in ("{", "[")
            and second[:1] in (" ", "\t"))


def _jsonl_rows(file: Path, lines: Iterable[str | RecordError]):
    lines = iter(lines)
    head = list(itertools.islice(lines, 2))
    if len(head) == 2 and _pretty_printed(*head):  # each of its lines would be a malformed record
        raise ValueError(f"{file}:1: not JSON lines: the file looks like one pretty-printed JSON document (line 1 is "
                         f"{head[0].strip()!r} alone, the lines after it indented); save it as .json, or write one "
                         "object per line (e.g. jq -c)")
    for n, line in enumerate(itertools.chain(head, lines), 1):
        if isinstance(line, RecordError):
            yield line.where, line
            continue
        if n == 1:  # a UTF-8 BOM (Windows editors), also before a blank first line
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        where = f"{file}:{n}"
        try:
            # without the line's end, so a record that breaks off is located on its own line (e.colno)
            row = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            yield where, RecordError(where, None, MALFORMED_JSON, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        except RecursionError:  # json's parser recurses once per nesting level
            yield where, RecordError(where, None, MALFORMED_JSON, "JSON nested too deeply to read")
            continue
        yield where, row if isinstance(row, dict) else RecordError(
            where, None, BAD_VALUE, f"expected a JSON object, got {type(row).__name__}")


_WS = re.compile(r"\s*")


def _json_rows(file: Path):
    """A JSON array of objects (each located by the line it starts on), else one object per line."""
    data = gzip.decompress(file.read_bytes()) if file.name.lower().endswith(".gz") else file.read_bytes()
    _refuse_binary(file, data[:8192])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # one JSON document: nothing after the bad byte can be located by record
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{file}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                         "re-encode the file as UTF-8") from None
    del data
    # a UTF-8 BOM (PowerShell's and Notepad's UTF-8): json.loads refuses it, and each line read as a bad record
    text = text.removeprefix("\ufeff")
    i = _WS.match(text).end()
    if not text.startswith("[", i):
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:  # not one document: treat it as JSON lines
            if _pretty_printed(*(text[i:].split("\n", 2) + ["", ""])[:2]):  # but it is one, broken
                raise ValueError(f"{file}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); a pretty-printed "
                                 "JSON document cannot be skipped record by record, fix the file (or write one "
                                 "object per line)") from None
            yield from _jsonl_rows(file, text.split("\n"))
            return
        yield f"{file}:{text.count(chr(10), 0, i) + 1}", row if isinstance(row, dict) else RecordError(
            f"{file}:1", None, BAD_VALUE, f"expected a JSON object or array, got {type(row).__name__}")
        return
    decoder = json.JSONDecoder()
    line, pos = 1, 0
    i = _WS.match(text, i + 1).end()
    while not text.startswith("]", i):
        line += text.count("\n", pos, i)
        pos = i
        try:
            row, end = decoder.raw_decode(text, i)
            i = _WS.match(text, end).end()
            if text.startswith(",", i):
                i = _WS.match(text, i + 1).end()
            elif not text.startswith("]", i):
                raise json.JSONDecodeError("expected ',' or ']'", text, i)
        except json.JSONDecodeError as e:
            # Inside one JSON array nothing after a syntax error can be trusted: stop, even under skip.
            raise ValueError(f"{file}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                             "a broken JSON array cannot be skipped record by record, fix the file") from None
        where = f"{file}:{line}"
        yield where, row if isinstance(row, dict) else RecordError(
            where, None, BAD_VALUE, f"expected a JSON object, got {type(row).__name__}")


def _csv_rows(file: Path):
    with open(file, "rb") as f:
        _refuse_binary(file, f.read(8192))
    # a cell as long as a JSON line may be: csv's default limit, 128 KiB (~32k tokens), refused the whole file over
    # one long document (the limit is the csv module's, process-wide; this only raises it)
    csv.field_size_limit(max(csv.field_size_limit(), MAX_RECORD_BYTES))
    # utf-8-sig: Excel's "CSV UTF-8" starts with a BOM, which would otherwise open the first column's name
    with open(file, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        start = 1
        try:
            reader.fieldnames  # reads the header line(s)
            start = reader.line_num + 1
            for row in reader:
                where = f"{file}:{start}"  # the line the record starts on (quoted cells may span lines)
                if None in row:  # DictReader puts the cells past the header's columns under the key None
                    yield where, RecordError(where, None, BAD_VALUE, f"{len(row) - 1 + len(row[None])} cells, the "
                                             f"header has {len(reader.fieldnames)} columns; quote a cell that holds "
                                             "a comma")
                else:
                    yield where, row
                start = reader.line_num + 1
        except UnicodeDecodeError as e:  # a CSV reader cannot resynchronise after a bad byte: not skippable
            raise ValueError(f"{file}: not UTF-8 text (byte 0x{e.object[e.start]:02x}) after line {start - 1}; "
                             "re-encode the file as UTF-8") from None
        except csv.Error as e:  # e.g. a cell over csv.field_size_limit() (MAX_RECORD_BYTES)
            raise ValueError(f"{file}:{start}: not readable as CSV ({e})") from None


def _arrow_rows(file: Path, kind: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{file}: reading {kind} files needs pyarrow; pip install pyarrow") from None
    n = 0
    try:
        if kind == "parquet":
            batches = pq.ParquetFile(file).iter_batches(batch_size=1024)
        else:  # datasets writes the Arrow IPC stream format; plain .arrow files may be the file format
            source = pa.memory_map(str(file))
            try:
                batches = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(k) for k in range(reader.num_record_batches))
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{file} row {n}", row
                n += 1
    except (pa.ArrowException, OSError) as e:  # a damaged or truncated file: the rows after it are lost
        raise ValueError(f"{file} row {n}: not a readable {kind} file ({e})") from None


# ---------------------------------------------------------------------------------------------
# rows -> examples


def read_source(src: SourceConfig, files: list[Path] | None = None) -> Iterator[Example | RecordError]:
    """Every record of a source, in file order, as an Example or the RecordError that rejects it."""
    roles = {**DEFAULT_ROLES, **src.roles}
    for file in files if files is not None else resolve_files(src.path):
        fmt = src.format  # auto: detected per file (a folder may hold files of several formats)
        for where, row in read_rows(file):
            if isinstance(row, RecordError):
                yield row
                continue
            if fmt == "auto":
                fmt = detect_format(row, src.columns, where)
                if fmt in ("text", "segments") and src.drop_system_message:
                    what = "plain text" if fmt == "text" else "template-free segments"
                    raise ValueError(f"{where}: {what} (format {fmt}), which has no system turn, but the source "
                                     f"{src.path} sets drop_system_message; unset it or give this file its own source")
            try:
                examples = to_examples(row, fmt, src.columns, roles, where)
            except RecordError as e:
                yield e
                continue
            for example in examples:  # one a row, or an OpenAssistant tree's threads, Self-Instruct's instances
                if isinstance(example, Example):
                    try:
                        example = _bounded(without_leading_system(example) if src.drop_system_message else example)
                    except RecordError as e:
                        example = e
                yield example


def without_leading_system(ex: Example) -> Example:
    """The example without its first turn when that is a system turn (SourceConfig.drop_system_message); a system
    turn later in the conversation stays, as under Axolotl's drop_system_message."""
    if ex.messages and ex.messages[0]["role"] == "system":
        ex.messages = ex.messages[1:]
    return ex


def text_of(ex: Example) -> str:
    """An example's text, every turn's or piece's concatenated: for sizes and messages."""
    if ex.text is not None:
        return ex.text
    if ex.segments is not None:
        return "".join(text for text, _ in ex.segments)
    return "".join(m.get("content") or "" for m in ex.messages)


def _bounded(ex: Example) -> Example:
    """The example, unless its text is over MAX_RECORD_BYTES characters (any format; JSON lines are bounded
    when read)."""
    size = len(text_of(ex))
    if size > MAX_RECORD_BYTES:
        raise RecordError(ex.where, None, TOO_LARGE, f"{size:,} characters of text, over the limit of "
                          f"{MAX_RECORD_BYTES:,} (gapless.data.formats.MAX_RECORD_BYTES); split it into records")
    return ex


# OpenAssistant's message table (oasst1's Hub parquet, its .messages.jsonl.gz): one message a row, linked by parent_id
OASST_MESSAGE_KEYS = ("message_id", "parent_id", "message_tree_id", "role", "text")
OASST_MESSAGE_TABLE = ("OpenAssistant's message table (one message a row, linked by parent_id), not conversations; "
                       "read the dataset's .trees.jsonl.gz file instead (OpenAssistant/oasst1's "
                       "2023-04-12_oasst_ready.trees.jsonl.gz), which format oasst reads")


def detect_format(row: dict, columns: dict[str, str], where: str) -> str:
    col = columns.get
    if "message_tree_id" in row and isinstance(row.get(col("prompt", "prompt")), dict):  # a tree's first message
        return "oasst"
    if all(k in row for k in OASST_MESSAGE_KEYS):  # its `text` column would read as format text, each message alone
        raise ValueError(f"{where}: {OASST_MESSAGE_TABLE}")
    turns = row.get(col("conversation", "conversation"), row.get(col("conversations", "conversations")))
    if _input_output_pairs(turns, columns):  # Capybara's, which read as ShareGPT turns have no role
        return "capybara"
    chat = row.get(col("chat", "chat"))
    if isinstance(chat, str) and GLAIVE_TURN.match(chat.lstrip()):  # glaive-function-calling-v2's transcript
        return "glaive"
    if isinstance(row.get(col("segments", "segments")), list):  # Axolotl's template-free input_output records
        return "segments"
    for fmt, keys in (("messages", ["messages"]), ("sharegpt", ["conversations"]), ("sharegpt", ["conversation"]),
                      ("alpaca", ["instruction"]),
                      ("prompt_completion", ["prompt", "completion"]), ("text", ["text"])):
        if all(col(k, k) in row for k in keys):
            return fmt
    looked = ("looked for messages (messages), conversations or conversation (sharegpt), instruction (alpaca), prompt "
              "and completion (prompt_completion), text (text), message_tree_id and a prompt object (oasst), "
              "conversation of {input, output} pairs (capybara), a chat string of USER:/ASSISTANT: turns (glaive), "
              "a list of segments (segments)")
    if "chosen" in row and "rejected" in row:  # DPO's pairs: TRL's preference type, Anthropic/hh-rlhf's transcripts
        chosen = row["chosen"]
        # whole conversations (argilla/dpo-mix-7k; mlabonne/orpo-dpo-mix-40k, whose prompt column repeats the user turn)
        whole = isinstance(chosen, list) and chosen and isinstance(chosen[0], dict) and chosen[0].get("role") in (
            "user", "system")
        mapping = ("{format: messages, columns: {messages: chosen}}" if whole
                   else "{format: prompt_completion, columns: {completion: chosen}}" if col("prompt", "prompt") in row
                   else "{format: messages, columns: {messages: chosen}}" if isinstance(chosen, list)
                   else "{format: text, columns: {text: chosen}} (every token of the transcript trained)"
                   if isinstance(chosen, str) and chosen.lstrip().startswith("Human:")  # hh-rlhf's transcripts
                   else "{format: prompt_completion, columns: {prompt: COLUMN, completion: chosen}}, COLUMN the "
                   "one that holds the question")
        raise ValueError(f"{where}: a preference pair (chosen, rejected), for DPO, not supervised fine-tuning data "
                         f"({looked}); to train its chosen answers, set the source's {mapping}")
    raise ValueError(f"{where}: cannot tell the format from the columns {sorted(row)} ({looked}); set the source's "
                     "format (messages, sharegpt, alpaca, prompt_completion, text, oasst, capybara, glaive, segments) "
                     "and "
                     "columns, e.g. {format: prompt_completion, columns: {prompt: question, completion: answer}}")


def _input_output_pairs(turns: Any, columns: dict[str, str]) -> bool:
    """Whether a conversation's first turn is a Capybara pair, {input, output} without a role (a JSON string of turns,
    a CSV's, parsed)."""
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            return False
    first = turns[0] if isinstance(turns, list) and turns else None
    return (isinstance(first, dict) and columns.get("input", "input") in first and columns.get("output", "output")
            in first and not any(k in first for k in ("role", "from", columns.get("role"), columns.get("from"))))


def to_examples(row: dict, fmt: str, columns: dict[str, str], roles: dict[str, str],
                where: str) -> list[Example | RecordError]:
    """A row's examples, or the RecordError of each that is bad: one, except an OpenAssistant tree (one a thread)
    and a Self-Instruct row (one an instance). A RecordError raised rejects the whole row."""
    if fmt in ("oasst", "oasst_top1"):
        key = columns.get("prompt", "prompt")
        root = row.get(key)
        if not isinstance(root, dict):
            raise RecordError(where, "prompt", MISSING_FIELD if root is None else BAD_VALUE,
                              f"expected the tree's first message, an object, got {type(root).__name__}; "
                              + (f"the record is a row of {OASST_MESSAGE_TABLE}" if root is None and all(
                                  k in row for k in OASST_MESSAGE_KEYS) else f"the record has {sorted(row)}"))
        tree = row.get("message_tree_id")
        # by the tree's id: a tree in two rows of the source is one group too; without an id, its row
        group = f"message_tree_id {tree}" if isinstance(tree, str) else where
        return _oasst_threads(root, where, group, top1=fmt == "oasst_top1")
    if fmt == "prompt_completion" and not _kto_label(row.get("label")):
        return [Skipped(where, "label", UNDESIRABLE_COMPLETION, "false: TRL's unpaired preference (KTO) marks this "
                        "completion as one not to learn")]
    name = columns.get("instances", "instances")
    output = columns.get("output", "output")
    if fmt == "alpaca" and row.get(output) is None and row.get("response") is None and name in row:
        return _instances(row, name, columns, roles, where)
    return [to_example(row, fmt, columns, roles, where)]


# a KTO label as text: a CSV cell holds a bool as pandas' to_csv and Excel write it
KTO_LABEL_TEXT = {"true": True, "false": False}


def _kto_label(value: Any) -> bool:
    """Whether a prompt-completion row trains, by its `label`: TRL's unpaired preference (KTO) label, a bool or its
    text ("True", "false": a CSV cell), false for a completion not to learn. Any other label (a class name, a number,
    an empty cell) is not KTO's, and the row trains as its other columns say, as any column the format does not read."""
    if isinstance(value, str):
        value = KTO_LABEL_TEXT.get(value.strip().lower(), value)
    return value is not False


def _instances(row: dict, name: str, columns: dict[str, str], roles: dict[str, str],
               where: str) -> list[Example | RecordError]:
    """Self-Instruct's {"instruction", "instances": [{"input", "output"}, ...]}: each instance an alpaca example, all
    of the row's group (Example.group)."""
    instances = row[name]
    if not isinstance(instances, list):
        raise RecordError(where, "instances", BAD_VALUE, f"expected a list of {{input, output}} objects, got "
                          f"{type(instances).__name__}")
    if not instances:
        raise RecordError(where, "instances", EMPTY_CONVERSATION, "no instances")
    keys = columns.get("input", "input"), columns.get("output", "output")
    rest = {k: v for k, v in row.items() if k != name}
    out: list[Example | RecordError] = []
    for k, instance in enumerate(instances):
        at = f"{where} instance {k + 1}"
        try:
            if not isinstance(instance, dict):
                raise RecordError(at, f"instances[{k}]", BAD_VALUE, f"expected an object, got "
                                  f"{type(instance).__name__}")
            if instance.get(keys[1]) is None:
                raise RecordError(at, f"instances[{k}].{keys[1]}", MISSING_FIELD,
                                  f"missing; the instance has {sorted(instance)}")
            example = to_example({**rest, **{key: instance[key] for key in keys if key in instance}}, "alpaca",
                                 columns, roles, at)
            example.group = where  # the row's instances share its instruction: held out together, as a task
            out.append(example)
        except RecordError as e:
            out.append(e)
    return out


# OpenAssistant's roles; its trees have no system or tool turns
OASST_ROLES = {"prompter": "user", "assistant": "assistant"}


def _oasst_threads(root: dict, where: str, group: str, top1: bool) -> list[Example | RecordError]:
    """An OpenAssistant message tree's root-to-leaf threads (the module docstring says which), depth first in the
    order of the replies, each of `group`. A malformed message rejects the tree (raised, located by its path from
    `prompt`)."""

    def kept(message: Any, field: str) -> bool:
        if not isinstance(message, dict):
            raise RecordError(where, field, BAD_VALUE, f"expected a message object, got {type(message).__name__}")
        # review_result is null until the reviews are in: only a rejected message (false) is left out
        return message.get("deleted") is not True and message.get("review_result") is not False

    def turn(message: dict, field: str) -> dict:
        role, text = message.get("role"), message.get("text")
        if role not in OASST_ROLES:
            raise RecordError(where, f"{field}.role", UNKNOWN_ROLE if isinstance(role, str) else BAD_VALUE,
                              f"expected one of {sorted(OASST_ROLES)}, got {role!r:.60}")
        if not isinstance(text, str):
            raise RecordError(where, f"{field}.text", MISSING_FIELD if text is None else BAD_VALUE,
                              f"expected a string, got {type(text).__name__}")
        return {"role": OASST_ROLES[role], "content": text}

    def replies(message: dict, field: str) -> list[tuple[dict, str]]:
        value = message.get("replies")
        if value is not None and not isinstance(value, list):
            raise RecordError(where, f"{field}.replies", BAD_VALUE, f"expected a list, got {type(value).__name__}")
        out = [(r, f"{field}.replies[{i}]") for i, r in enumerate(value or []) if kept(r, f"{field}.replies[{i}]")]
        return [min(out, key=lambda r: _rank(r[0]))] if top1 and out else out  # min: the first of equal ranks

    if not kept(root, "prompt"):
        return [Skipped(where, "prompt", NO_ASSISTANT_TURN, "the prompt is deleted or rejected: no thread")]
    threads = []
    stack = [(root, "prompt", [])]  # iterative: no recursion limit on a thread's depth
    while stack:
        message, field, path = stack.pop()
        path = path + [turn(message, field)]
        children = replies(message, field)
        if not children:
            threads.append(path)
        stack.extend((child, f, path) for child, f in reversed(children))
    out: list[Example | RecordError] = []
    seen: dict[tuple[int, ...], str] = {}  # a cut thread's messages (threads share their prefix's turn dicts) -> where
    for k, thread in enumerate(threads, 1):
        at = where if top1 else f"{where} thread {k}"
        ends = [i for i, m in enumerate(thread) if m["role"] == "assistant"]
        if not ends:
            out.append(Skipped(at, None, NO_ASSISTANT_TURN, "no assistant turn (an unanswered prompt)"))
            continue
        cut = thread[:ends[-1] + 1]
        key = tuple(id(m) for m in cut)
        if key in seen:
            out.append(Skipped(at, None, DUPLICATE_THREAD, f"the same turns as {seen[key]} once cut to its last "
                               "assistant turn (unanswered follow-ups)"))
            continue
        seen[key] = at
        out.append(Example(at, messages=[dict(m) for m in cut], group=group))  # each thread its own turns
    return out


def _rank(message: dict) -> tuple[int, float]:
    """The sort key of a reply for oasst_top1: its rank (0 = the best), an unranked reply after every ranked one."""
    rank = message.get("rank")
    ranked = isinstance(rank, (int, float)) and not isinstance(rank, bool) and rank == rank  # not NaN
    return (0, rank) if ranked else (1, 0)


def to_example(row: dict, fmt: str, columns: dict[str, str], roles: dict[str, str], where: str) -> Example:
    def field(name: str, required: bool = True) -> Any:
        key = columns.get(name, name)
        if key is None:  # mapped to null: not read (SourceConfig.columns)
            return None
        value = row.get(key)
        if value is None or (value == "" and not required):
            if required:
                mapped = f" (column {key!r})" if key != name else ""
                raise RecordError(where, name, MISSING_FIELD,
                                  f"missing{mapped}; the record has {sorted(row)}; map another column "
                                  f"with the source's columns: {{{name}: NAME}}")
            return None
        return value

    def text(name: str, required: bool = True) -> str | None:
        value = field(name, required)
        if value is not None and not isinstance(value, str):
            raise RecordError(where, name, BAD_VALUE, f"expected a string, got {type(value).__name__}")
        return value

    if fmt == "text":
        if not text("text").strip():  # bos and eos alone: a document that teaches the model to stop at once
            raise RecordError(where, "text", BAD_VALUE, "empty text")
        return Example(where, text=text("text"))
    if fmt == "segments":
        return Example(where, segments=_segments(_json_list(field("segments"), "segments", where), where))
    if fmt == "messages":
        turns = _json_list(field("messages"), "messages", where)
        messages = [_message(t, i, "messages", *_turn_keys(t, columns, "role"), roles, where)
                    for i, t in enumerate(turns)]
        tools = field("tools", False)
        if tools is None and columns.get("tools", "tools") and isinstance(row.get("functions"), list):
            # OpenAI's legacy function definitions
            tools = [{"type": "function", "function": f} for f in row["functions"]]
        return Example(where, messages=messages, tools=_tools(tools, where))
    if fmt == "sharegpt":
        # lmsys-chat-1m and WildChat name the list `conversation`
        name = ("conversation" if "conversations" not in columns and "conversations" not in row
                and "conversation" in row else "conversations")
        turns = _json_list(field(name), name, where)
        messages = [_message(t, i, name, *_turn_keys(t, columns, "from"), roles, where) for i, t in enumerate(turns)]
        system = text("system", False)
        return Example(where, messages=([{"role": "system", "content": system}] if system else []) + messages,
                       tools=_tools(field("tools", False), where))
    if fmt == "capybara":
        name = ("conversations" if "conversation" not in columns and "conversation" not in row
                and "conversations" in row else "conversation")
        return Example(where, messages=_pairs(_json_list(field(name), name, where), name, columns, where))
    if fmt == "glaive":
        system, tools = _glaive_system(text("system", False), where)
        return Example(where, messages=([{"role": "system", "content": system}] if system else [])
                       + _glaive_turns(text("chat"), tools, where), tools=tools)
    if fmt == "alpaca":
        # GPTeacher and Dolly name the answer `response`; Dolly names the input `context` (read as any other
        # column, it was left out of the prompt: a closed-QA answer trained without its passage)
        extra = "context" if "input" not in columns and "input" not in row and "context" in row else "input"
        response = "response" if "output" not in columns and "output" not in row and "response" in row else "output"
        instruction, extra, system = text("instruction"), text(extra, False), text("system", False)
        user = instruction + (f"\n\n{extra}" if extra else "")
        chat = _chat(system, user, text(response))
        history = columns.get("history", "history")  # (an empty string is a bad history, not an absent one)
        return Example(where, messages=chat[:-2] + _history(row.get(history) if history else None, where) + chat[-2:])
    if fmt == "prompt_completion":
        prompt, completion = field("prompt"), field("completion")
        if isinstance(prompt, list) or isinstance(completion, list):  # TRL's conversational prompt-completion
            turns = {}
            for name, value in (("prompt", prompt), ("completion", completion)):
                if not isinstance(value, list):
                    raise RecordError(where, name, BAD_VALUE, f"expected a list of turns like the other field, got "
                                      f"{type(value).__name__}")
                turns[name] = [_message(t, i, name, *_turn_keys(t, columns, "role"), roles, where)
                               for i, t in enumerate(_json_list(value, name, where))]
            system = text("system", False)
            return Example(where, messages=([{"role": "system", "content": system}] if system else [])
                           + turns["prompt"] + turns["completion"], tools=_tools(field("tools", False), where))
        return Example(where, messages=_chat(text("system", False), text("prompt"), text("completion")),
                       tools=_tools(field("tools", False), where))
    raise AssertionError(fmt)


def _segments(pieces: list, where: str) -> list[tuple[str, bool]]:
    """Axolotl's input_output segments, [{"label": bool, "text": str}, ...], as (text, trained) pairs."""
    out = []
    for i, piece in enumerate(pieces):
        if not (isinstance(piece, dict) and isinstance(piece.get("text"), str)
                and isinstance(piece.get("label"), bool)):
            raise RecordError(where, f"segments[{i}]", BAD_VALUE, f"expected {{\"label\": true|false, \"text\": "
                              f"\"...\"}}, got {json.dumps(piece)[:60]}")
        out.append((piece["text"], piece["label"]))
    return out


def _chat(system: str | None, user: str, assistant: str) -> list[dict]:
    return (([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])


def _pairs(pairs: list, name: str, columns: dict[str, str], where: str) -> list[dict]:
    """Capybara's conversation, [{"input", "output"}, ...], as messages: each input a user turn, its output the
    assistant's answer."""
    messages = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, dict):
            raise RecordError(where, f"{name}[{i}]", BAD_VALUE, f"expected an {{input, output}} object, got "
                              f"{type(pair).__name__}")
        for role, key in (("user", columns.get("input", "input")), ("assistant", columns.get("output", "output"))):
            value = pair.get(key)
            if not isinstance(value, str):
                raise RecordError(where, f"{name}[{i}].{key}", MISSING_FIELD if value is None else BAD_VALUE,
                                  f"missing; the turn has {sorted(pair)}" if value is None
                                  else f"expected a string, got {type(value).__name__}")
            messages.append({"role": role, "content": value})
    return messages


# glaiveai/glaive-function-calling-v2: the system text's lead-in before its function definitions (the system text of
# a row without functions is "SYSTEM: You are a helpful assistant, with no access to external functions.")
GLAIVE_LEAD_IN = "You are a helpful assistant with access to the following functions. Use them if required -"
# a turn's marker, at the chat's start or after a blank line (turns are apart by "\n\n\n", in some rows "\n\n")
GLAIVE_TURN = re.compile(r"(?:\A|\n\n+)(USER|ASSISTANT|FUNCTION RESPONSE):")
GLAIVE_END = "<|endoftext|>"  # the end of each assistant turn
# a call as glaive writes it: the arguments a JSON object inside single quotes (a Python literal, which may hold an
# apostrophe: "let's"), not a JSON string
GLAIVE_CALL = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*\'(.*)\'\s*\}', re.DOTALL)


def _glaive_system(text: str | None, where: str) -> tuple[str | None, list | None]:
    """glaive's system text -> (the system message, the tools): after GLAIVE_LEAD_IN, JSON function definitions
    (pretty-printed, apart by blank lines) and nothing else, as tools and no system message; other text as it is."""
    body = (text or "").strip().removeprefix("SYSTEM:").strip()
    if not body.startswith(GLAIVE_LEAD_IN):
        return body or None, None
    rest, tools, decoder = body[len(GLAIVE_LEAD_IN):], [], json.JSONDecoder()
    i = _WS.match(rest).end()
    while i < len(rest):
        try:
            function, i = decoder.raw_decode(rest, i)
        except json.JSONDecodeError as e:
            raise RecordError(where, "system", MALFORMED_JSON, f"function definition {len(tools) + 1} after the "
                              f"lead-in is not valid JSON ({e.msg}): {rest[e.pos:e.pos + 40]!r}") from None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise RecordError(where, "system", BAD_VALUE, f"function definition {len(tools) + 1} after the lead-in: "
                              f"expected an object with a name, got {json.dumps(function)[:60]}")
        tools.append({"type": "function", "function": function})
        i = _WS.match(rest, i).end()
    if not tools:
        raise RecordError(where, "system", BAD_VALUE, "the lead-in to function definitions, and none after it")
    return None, tools


def _glaive_turns(chat: str, tools: list | None, where: str) -> list[dict]:
    """glaive's chat string -> messages: USER a user turn, ASSISTANT an assistant turn (less its <|endoftext|>; a
    <functioncall> in it its tool call, the text before it its content), FUNCTION RESPONSE the result of the call
    just before it."""
    chat = chat.strip()
    marks = list(GLAIVE_TURN.finditer(chat))
    if not marks or marks[0].start() != 0:
        raise RecordError(where, "chat", BAD_VALUE, f"expected a turn marker (USER:, ASSISTANT:, FUNCTION RESPONSE:) "
                          f"at the start, got {chat[:40]!r}")
    defined = [t["function"]["name"] for t in tools or []]
    messages: list[dict] = []
    for k, (mark, after) in enumerate(zip(marks, marks[1:] + [None]), 1):
        role, text = mark[1], chat[mark.end():after.start() if after else len(chat)].strip()

        def bad(problem: str, reason: str = BAD_VALUE) -> RecordError:
            return RecordError(where, "chat", reason, f"turn {k} ({role}): {problem}")

        if role == "ASSISTANT":
            text = text.removesuffix(GLAIVE_END).rstrip()
        if GLAIVE_END in text:  # a turn marker lost: one turn's text runs on into the next
            raise bad(f"{GLAIVE_END} inside the turn, not at an answer's end: {_around(text, GLAIVE_END)!r}")
        if role == "USER":
            messages.append({"role": "user", "content": text})
        elif role == "FUNCTION RESPONSE":
            if not (messages and messages[-1].get("tool_calls")):
                raise bad("a function response to no call (the turn before it is not a <functioncall>)")
            messages.append({"role": "tool", "content": text})
        elif "<functioncall>" in text:
            before, call = text.split("<functioncall>", 1)
            if "<functioncall>" in call:
                raise bad("two <functioncall>s in one turn")
            name, arguments = _glaive_call(call, bad)
            if name not in defined:
                raise bad(f"a call to {name!r}, which the system text does not define "
                          f"({'it defines ' + ', '.join(defined) if defined else 'it defines no functions'})")
            messages.append({"role": "assistant", "content": before.strip() or None,
                             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]})
        else:
            messages.append({"role": "assistant", "content": text})
    return messages


def _glaive_call(text: str, bad) -> tuple[str, dict]:
    """The name and arguments of a glaive call, `{"name": ..., "arguments": '{...}'}` (or arguments as a JSON
    object, or none: {}); `bad(problem, reason)` makes the error."""
    text = text.strip()
    quoted = GLAIVE_CALL.fullmatch(text)
    try:
        if quoted:
            name, arguments = quoted[1], quoted[2]
            try:
                arguments = _strict_json(arguments)
            except ValueError:  # a backslash before an apostrophe: the Python literal's escape, which JSON has not
                arguments = _strict_json(arguments.replace("\\'", "'"))
        else:
            call = _strict_json(text)
    except ValueError as e:
        raise bad(f"the call is not JSON ({e.msg if isinstance(e, json.JSONDecodeError) else e}): {text[:80]!r}",
                  MALFORMED_JSON) from None
    if not quoted:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and set(call) <= {"name", "arguments"}):
            raise bad(f"expected <functioncall> {{\"name\": ..., \"arguments\": ...}}, got {text[:80]!r}")
        name, arguments = call["name"], call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise bad(f"the call's arguments are not a JSON object: {text[:80]!r}")
    return name, arguments


def _strict_json(text: str) -> Any:
    """JSON, without the NaN and Infinity that Python's json reads and JSON has not."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _around(text: str, part: str, width: int = 30) -> str:
    at = text.find(part)
    return text[max(0, at - width):at + len(part) + width]


def _history(value: Any, where: str) -> list[dict]:
    """LLaMA-Factory's alpaca `history`, the turns before the instruction as [[user, assistant], ...], as messages."""
    if value is None:
        return []
    if not (isinstance(value, list) and all(isinstance(pair, list) and len(pair) == 2
                                            and all(isinstance(t, str) for t in pair) for pair in value)):
        raise RecordError(where, "history", BAD_VALUE, f"expected a list of [user, assistant] pairs of strings "
                          f"(LLaMA-Factory's alpaca history), got {json.dumps(value)[:60]}")
    return [{"role": role, "content": t} for pair in value for role, t in zip(("user", "assistant"), pair)]


def _json_list(value: Any, name: str, where: str) -> list:
    if isinstance(value, str):  # CSV and some Parquet files hold the conversation as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RecordError(where, name, MALFORMED_JSON, f"not valid JSON ({e.msg})") from None
    if not isinstance(value, list):
        raise RecordError(where, name, BAD_VALUE, f"expected a list of turns, got {type(value).__name__}")
    if not value:
        raise RecordError(where, name, EMPTY_CONVERSATION, "empty conversation")
    return value


# a format's turn keys (role, content) -> the other common pair
OTHER_TURN_KEYS = {"role": ("from", "value"), "from": ("role", "content")}


def _turn_keys(turn: Any, columns: dict[str, str], role: str) -> tuple[str, str]:
    """A turn's role and content keys: the format's (`role` and `content`, ShareGPT's `from` and `value`) or the
    columns' mapping; where neither is mapped, the other pair when the turn has it and not the format's (hub datasets
    put ShareGPT turns under `messages` and role/content turns under `conversations`)."""
    content = {"role": "content", "from": "value"}[role]
    keys = columns.get(role, role), columns.get(content, content)
    if role in columns or content in columns or not isinstance(turn, dict) or keys[0] in turn:
        return keys
    other = OTHER_TURN_KEYS[role]
    return other if other[0] in turn else keys


def _message(turn: Any, i: int, name: str, role_key: str, content_key: str, roles: dict[str, str],
             where: str) -> dict:
    field = f"{name}[{i}]"
    if not isinstance(turn, dict):
        raise RecordError(where, field, BAD_VALUE, f"expected an object, got {type(turn).__name__}")
    if role_key not in turn:
        pairs = "input" in turn and "output" in turn  # Capybara's turns: one {input, output} pair each
        raise RecordError(where, f"{field}.{role_key}", MISSING_FIELD, f"missing; the turn has {sorted(turn)}"
                          + ("; {input, output} pairs (LDJnr/Capybara's) are format capybara" if pairs else ""))
    if not isinstance(turn[role_key], str):
        raise RecordError(where, f"{field}.{role_key}", BAD_VALUE,
                          f"expected a string, got {type(turn[role_key]).__name__} {turn[role_key]!r:.60}")
    role = roles.get(turn[role_key])
    if role is None:
        raise RecordError(where, f"{field}.{role_key}", UNKNOWN_ROLE,
                          f"unknown role {turn[role_key]!r}; known: {sorted(roles)}; map it with the "
                          f"source's roles: {{{turn[role_key]}: user|assistant|system|tool|tool_call}}")
    content = turn.get(content_key)
    if isinstance(content, list):  # OpenAI's content parts: [{"type": "text", "text": ...}, ...]
        content = _text_parts(content, where, f"{field}.{content_key}")
    if isinstance(turn.get("function_call"), dict) and not turn.get("tool_calls"):
        # OpenAI's legacy function calling: one call, {"name", "arguments"}, beside a null content; as tool_calls
        turn = {**{k: v for k, v in turn.items() if k != "function_call"},
                "tool_calls": [{"type": "function", "function": turn["function_call"]}]}
    if content is None and not turn.get("tool_calls"):
        raise RecordError(where, f"{field}.{content_key}", MISSING_FIELD, f"missing; the turn has {sorted(turn)}")
    if content is not None and not isinstance(content, str):
        raise RecordError(where, f"{field}.{content_key}", BAD_VALUE,
                          f"expected a string, got {type(content).__name__}")
    # a null key is an absent one: datasets' exports (to_json, to_parquet) give every turn every key of any turn,
    # null where it had none (`"weight": null` beside OpenAI's weight 0, `"tool_calls": null`, `"name": null`)
    message = {k: v for k, v in turn.items() if k not in (role_key, content_key) and v is not None}
    if "weight" in message:  # OpenAI's fine-tuning format: an assistant message of weight 0 is not trained
        weight = message["weight"]
        if isinstance(weight, bool) or weight not in (0, 1):
            raise RecordError(where, f"{field}.weight", BAD_VALUE, f"expected 0 or 1 (OpenAI's per-message weight: 0 "
                              f"leaves an assistant message out of the loss), got {weight!r}")
        message["weight"] = int(weight)
    message.update(role=role, content=content)
    if role == "tool_call":
        message.update(role="assistant", is_tool_call=True)
    return message


def _text_parts(parts: list, where: str, field: str) -> str:
    """The text of a turn given as content parts, concatenated; a part of another type (an image, audio) refused."""
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RecordError(where, f"{field}[{j}]", BAD_VALUE, f"a {kind!r} content part; gapless trains on text: "
                              "keep the text parts ({type: text, text: ...}) or remove the record")
    return "".join(texts)


def _tools(value: Any, where: str) -> list | None:
    if value is None:
        return None
    if isinstance(value, str):  # glaive and LLaMA-Factory keep the tool list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RecordError(where, "tools", MALFORMED_JSON, f"not valid JSON ({e.msg})") from None
    if not isinstance(value, list):
        raise RecordError(where, "tools", BAD_VALUE, f"expected a list of tool definitions, got {type(value).__name__}")
    return [_without_null_keys(tool) for tool in value]


# JSON schema's keywords whose value is data, not a schema: a null there is a value (`default: null`), kept as it is
SCHEMA_VALUES = ("default", "const", "enum", "examples", "example")
# JSON schema's keywords whose keys are names (of parameters, definitions), each holding a schema
SCHEMA_NAMES = ("properties", "patternProperties", "$defs", "definitions")


def _without_null_keys(schema: Any, names: bool = False) -> Any:
    """A tool definition without its null-valued keys. Arrow stores a column of tools as one struct type, so a
    Parquet/Arrow file (datasets' push_to_hub, to_json) gives each tool every other tool's parameters and fields, null
    where it had none (get_weather's properties {city, query: null, limit: null}); no schema is null, so they are
    absent ones. The values of SCHEMA_VALUES are left as they are; `names`: the keys are a SCHEMA_NAMES map's."""
    if isinstance(schema, list):
        return [_without_null_keys(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in SCHEMA_VALUES and not names:
            out[k] = v
        elif v is not None:
            out[k] = _without_null_keys(v, names=not names and k in SCHEMA_NAMES)
    return out
