"""The `gapless` command on a user's mistakes: one line that names the file, field or argument, a non-zero exit
code and no traceback (GAPLESS_DEBUG=1 gives it back); the config's loader reads what the user meant."""
import io
import json

import pytest
import yaml

from gapless.cli import main
from gapless.config import LoraConfig, TrainConfig, from_dict, load_config
from gapless.demo import write_base_model
from test_report import make_run


def error_of(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_base_model(tmp_path_factory.mktemp("cli") / "base", seed=0)


def test_a_path_that_cannot_be_written_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    a, b = make_run(tmp_path / "a", steps=20, gpu=False, gap=False), make_run(tmp_path / "b", steps=20, gpu=False,
                                                                             gap=False)
    out = tmp_path / "missing" / "parent" / "compare.html"
    code, err = error_of(capsys, "report", str(a), str(b), "--out", str(out))
    assert code == 1 and err.strip() == f"gapless report: error: {out}: No such file or directory"
    monkeypatch.setenv("GAPLESS_DEBUG", "1")  # the traceback, for a bug report
    with pytest.raises(FileNotFoundError):
        main(["report", str(a), str(b), "--out", str(out)])
    with pytest.raises(ValueError, match="x.yaml: config file not found"):
        main(["plan", str(tmp_path / "x.yaml")])


def test_config_path_mistakes(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {path: m}\n")
    code, err = error_of(capsys, "plan", str(run))
    assert code == 2 and f"{run}: a folder, not a config file" in err and f"{run / 'config.yaml'}" in err
    tab = tmp_path / "tab.yaml"
    tab.write_text("model:\n\tpath: m\n")
    code, err = error_of(capsys, "train", str(tab))
    assert code == 2 and "line 2" in err and "YAML indents with spaces, not tabs" in err
    for text in ("", "# model: {path: m}\n"):  # empty, or comments only: said so, not two missing fields
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        for command in ("train", "plan", "doctor"):
            code, err = error_of(capsys, command, str(empty))
            assert code == 2 and f"{empty}: holds no settings (empty, or comments only)" in err, (command, err)
            assert "required field" not in err
    code, err = error_of(capsys, "plan", str(empty), "model.path=m")  # its settings given as overrides instead
    assert code == 2 and "data: required field is missing" in err


def test_an_override_with_an_empty_key_part(tmp_path):
    for bad in ("=3", "lora..r=3", "lora.=3"):
        with pytest.raises(ValueError, match=rf"override '{bad}': the key has an empty part"):
            load_config(data={"model": {"path": "m"}, "data": {"sources": [{"path": "x"}]}}, overrides=[bad])


def test_help_does_not_call_the_overrides_required(capsys):
    for command in ("train", "plan", "gap", "compare-precision"):
        with pytest.raises(SystemExit) as e:
            main([command])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "required" in err and "KEY=VALUE" not in err.splitlines()[-1]


def test_whole_numbers_are_integers_and_other_tools_names_are_suggested():
    assert from_dict(LoraConfig, {"r": 16.0}).r == 16
    steps = [from_dict(TrainConfig, {"steps": v}).steps for v in ("100", "1e3", 2.0e3, " 12 ")]
    assert steps == [100, 1000, 2000, 12] and all(type(s) is int for s in steps)
    for bad in (16.5, "1.5e0", "ten", True, "1e-3"):
        with pytest.raises(ValueError, match="train.steps: expected an integer"):
            from_dict(TrainConfig, {"steps": bad}, "train")
    for cls, key, field in ((LoraConfig, "rank", "r"), (LoraConfig, "lora_alpha", "alpha"),
                            (TrainConfig, "max_steps", "steps"), (TrainConfig, "gradient_accumulation_steps",
                                                                   "grad_accum")):
        with pytest.raises(ValueError, match=rf"{key}: unknown key; did you mean '{field}'\?"):
            from_dict(cls, {key: 1})


def test_generate_checks_its_arguments_before_loading(tmp_path, capsys):
    for args, says in ((["--max-new-tokens", "-3"], "--max-new-tokens: -3"),
                       (["--temperature", "-1"], "--temperature: -1.0"), (["--top-p", "0"], "--top-p: 0.0")):
        code, err = error_of(capsys, "generate", str(tmp_path / "nothing"), "--prompt", "hi", *args)
        assert code == 2 and says in err
    code, err = error_of(capsys, "generate", str(tmp_path / "nothing"), "--prompt", "hi")
    assert code == 2 and f"{tmp_path / 'nothing'}: not found" in err
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000005"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text("{}")
    code, err = error_of(capsys, "generate", str(checkpoint), "--prompt", "hi")
    assert code == 2 and f"a training checkpoint; export it first (gapless export {checkpoint}" in err
    code, err = error_of(capsys, "export", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"))
    assert code == 2 and f"{tmp_path / 'nothing'}: not found" in err


def test_a_device_name_torch_does_not_know(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "tokenizer.json").write_text("{}")
    code, err = error_of(capsys, "generate", str(model), "--prompt", "hi", "--device", "gpu")
    assert code == 2 and "--device: 'gpu' is not one of auto, cpu, cuda, cuda:N" in err
    for bad in ("cudax", "cuda:x", "gpu"):
        with pytest.raises(ValueError, match=f"model.device: '{bad}' is not one of"):
            load_config(data={"model": {"path": "m", "device": bad}, "data": {"sources": [{"path": "x"}]}})


def test_chat_goes_on_after_a_prompt_the_tokenizer_cannot_encode(base, capsys, monkeypatch):
    """The demo's character tokenizer has no unknown token: `!` raised the tokenizers library's bare Exception."""
    code, err = error_of(capsys, "generate", str(base), "--prompt", "hi!", "--max-new-tokens", "2", "--device",
                         "cpu")
    assert code == 2 and "the tokenizer cannot encode the prompt" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("hi!\nab\n/exit\n"))
    code = main(["chat", str(base), "--max-new-tokens", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0 and "error: the tokenizer cannot encode the prompt" in err and out.count("model> ") == 1


def test_yaml_reads_exponents_without_a_dot_as_strings_and_the_config_reads_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `2e-4` as the string '2e-4' and `2.0e-4` as a float: both are the number."""
    assert yaml.safe_load("lr: 2e-4")["lr"] == "2e-4" and yaml.safe_load("lr: 2.0e-4")["lr"] == 2.0e-4
    raw = {"model": {"path": "m"}, "data": {"sources": [{"path": "x"}]}}
    for text in ("2e-4", "2.0e-4", "'2e-4'"):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(raw) + f"optim: {{lr: {text}}}\ntrain: {{steps: 1e2}}\n")
        cfg = load_config(path)
        assert cfg.optim.lr == 2e-4 and cfg.train.steps == 100


def test_numbers_of_the_subcommands_arguments(tmp_path, capsys):
    """A count a command cannot honour was clamped or read another way: `data --example 10**5` showed the last
    document, `demo --steps 0` ran a pass over the data (train.steps 0), `compare-precision --steps 0` compared
    nothing."""
    from gapless import demo_task

    data = demo_task.write_jsonl(demo_task.make_examples(5, seed=1), tmp_path / "train.jsonl")
    tokenizer = demo_task.write_tokenizer(tmp_path / "tok")
    code, err = error_of(capsys, "data", str(data), "--tokenizer", str(tokenizer), "--set", f"cache_dir={tmp_path}",
                         "--example", "5")
    assert code == 2 and "--example: 5; the data has 5 documents, give 0 to 4" in err
    code, err = error_of(capsys, "data", str(data), "--example", "-1")
    assert code == 2 and "--example: -1" in err
    for argv, says in ((["demo", "--steps", "0", "--out", str(tmp_path / "demo")], "--steps: 0"),
                       (["compare-precision", str(tmp_path / "c.yaml"), "--steps", "0"], "--steps: 0"),
                       (["eval", str(tmp_path), "--gsm8k", str(data), "--limit", "0"], "--limit 0"),
                       (["train", str(tmp_path / "c.yaml"), "--dry-run", "--gpu-gib", "-3"], "--gpu-gib: -3.0"),
                       (["doctor", "--compare", str(tmp_path), str(tmp_path / "nothing")],
                        f"--compare: {tmp_path / 'nothing'} is not a folder")):
        code, err = error_of(capsys, *argv)
        assert code == 2 and says in err, argv
    assert not (tmp_path / "demo").exists()


def test_a_run_whose_config_yaml_was_broken_by_hand(tmp_path, capsys):
    """Every command that reads a run folder's config.yaml: yaml's ParserError was a traceback."""
    run = make_run(tmp_path / "run", steps=20, gpu=False, gap=False)
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "config.yaml").write_text("model: {path: m\n")
    for argv in (["report", str(run)], ["export", str(run), "--out", str(tmp_path / "out")],
                 ["generate", str(run), "--prompt", "hi"], ["eval", str(run), "--data", str(tmp_path)],
                 ["doctor", "--compare", str(run), str(run)]):
        code, err = error_of(capsys, *argv)
        assert code == 2 and f"{run / 'config.yaml'}: not valid YAML" in err and "line 2" in err, argv


def test_python_dash_m_gapless_is_the_command():
    """`python -m gapless` where the environment's scripts folder is not on PATH: the same command, its exit codes
    included (it printed "No module named gapless.__main__")."""
    import subprocess
    import sys

    from gapless import __version__

    done = subprocess.run([sys.executable, "-m", "gapless", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and __version__ in done.stdout + done.stderr, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "gapless", "train", "nope.yaml"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "nope.yaml" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_commands_warning_is_one_line_naming_the_command(base, tmp_path, capsys):
    """`gapless train --dry-run` reads the data outside the run's progress, which formats its own warnings: a data
    warning printed as Python's two lines (`.../gapless/meter/memory.py:295: UserWarning: ...` and the source line);
    it is `gapless train: warning: ...`, once."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    record = {"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}],
              "tools": tools}
    (tmp_path / "d.jsonl").write_text((json.dumps(record) + "\n") * 3)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(base), "device": "cpu"}, "output_dir": str(tmp_path / "r"),
                                      "data": {"sources": [{"path": str(tmp_path / "d.jsonl")}], "max_seq_len": 64,
                                               "tokens_per_batch": 128, "cache_dir": str(tmp_path / "cache")}}))
    with pytest.warns(UserWarning, match="tool definitions that the chat template does not render"):  # recorded too
        assert main(["train", str(config), "--dry-run"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line.lower()]
    assert lines == [f"gapless train: warning: {tmp_path / 'd.jsonl'}: 3 records have tool definitions that the chat "
                     "template does not render (it never mentions `tools`); they are left out"], err
