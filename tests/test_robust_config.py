"""Bad configs that passed validation or ended in a traceback (issue robust:): each is now a ValueError naming the
field, or a warning where the value may be meant."""
import copy
import os
import subprocess
import warnings

import pytest

from gapless.config import load_config

MINIMAL = {"model": {"path": "models/tiny"}, "data": {"sources": [{"path": "train.jsonl"}]}}


def config(*overrides):
    return load_config(data=copy.deepcopy(MINIMAL), overrides=list(overrides))  # overrides edit the dict in place


@pytest.mark.parametrize("override,says", [
    ("optim.lr=.inf", "config.optim.lr: must be a finite number"),
    ("optim.lr=.nan", "config.optim.lr: must be a finite number"),
    ("optim.weight_decay=.nan", "config.optim.weight_decay: must be a finite number"),
    ("optim.eps=.inf", "config.optim.eps: must be a finite number"),
    ("optim.grad_clip=.nan", "config.optim.grad_clip: must be a finite number"),
    ("lora.alpha=-16", "config.lora.alpha: must be a positive number"),
    ("lora.alpha=0", "config.lora.alpha: must be a positive number"),
    ("lora.alpha=.nan", "config.lora.alpha: must be a positive number"),
    ("train.epochs=.inf", "config.train: steps is 0 and epochs is inf"),
    ("data.sources.0.weight=.nan", "config.data.sources[0].weight: must be positive"),
    ("data.sources.0.epochs=.inf", "config.data.sources[0].epochs: must be positive"),
    ("schedule.min_lr_ratio=.nan", "config.schedule.min_lr_ratio"),
    ("lora.dropout=.nan", "config.lora.dropout"),
])
def test_non_finite_and_negative_values_are_refused(override, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        config(override)


def test_an_output_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"config.output_dir: .*/file is a file"):
        config(f"output_dir={tmp_path / 'file'}").check_output_dir()
    with pytest.raises(ValueError, match=r"config.output_dir: .*/file/run cannot be created: .*/file is a file"):
        config(f"output_dir={tmp_path / 'file' / 'run'}").check_output_dir()
    config(f"output_dir={tmp_path / 'a' / 'b'}").check_output_dir()  # created later: fine


def test_a_read_only_output_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: a read-only mount instead
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
                          capture_output=True).returncode:
            pytest.skip("root, and cannot mount a read-only tmpfs")
    else:
        ro.chmod(0o555)
    try:
        with pytest.raises(ValueError, match=r"config.output_dir: .*/ro/run is not writable"):
            config(f"output_dir={ro / 'run'}").check_output_dir()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)
        else:
            ro.chmod(0o755)


def test_a_binary_config_file_is_named(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    with pytest.raises(ValueError, match=r"config.yaml: not a text file"):
        load_config(path)


def test_max_seq_len_above_the_models_positions_warns():
    cfg = config("data.max_seq_len=8192", "data.tokens_per_batch=8192")
    with pytest.warns(UserWarning, match="data.max_seq_len: 8,192 is above the model's max_position_embeddings 4,096"):
        cfg.check_model(4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.check_model(8192)


def test_max_seq_len_above_the_positions_of_a_dynamic_rope_model_is_refused():
    """Dynamic NTK RoPE (transformers' rope_type dynamic) is plain RoPE up to max_position_embeddings and rescaled
    past it, which gapless does not do: longer sequences are an error, not the warning of plain RoPE."""
    cfg = config("data.max_seq_len=8192", "data.tokens_per_batch=8192")
    with pytest.raises(ValueError, match=r"config\.data\.max_seq_len: 8,192 is above the model's "
                                         r"max_position_embeddings 4,096 .*rope_type 'dynamic'.*lower "
                                         r"data\.max_seq_len to 4,096"):
        cfg.check_model(4096, "dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.check_model(8192, "dynamic")
