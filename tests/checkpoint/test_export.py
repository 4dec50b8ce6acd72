"""`halfprec export` / `halfprec inspect`: consolidated weights from the masters, strict-loadable."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from halfprec.cli.main import main

from ..engine_util import TiedLM, build, legacy_checkpoint, train


def test_export_writes_masters_under_every_state_dict_key(tmp_path, capsys):
    engine = build("bf16")
    train(engine, 3)
    engine.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    weights = load_file(str(out))
    plain = TiedLM()
    assert set(weights) == set(plain.state_dict())
    plain.load_state_dict(weights, strict=True)
    names = [n for n, _ in engine.module.named_parameters()]
    for name, master in zip(names, engine.optimizer.master_params(), strict=True):
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], master)
    assert torch.equal(weights["head.weight"], weights["emb.weight"])
    assert (
        main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "b.safetensors"), "--dtype", "bf16"])
        == 0
    )
    assert load_file(str(tmp_path / "b.safetensors"))["mix.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("save", "optimizer", "file"),
    [
        (
            lambda engine, root: engine.save_checkpoint(root),
            "AdamW, DynamicLossScaler (reshardable)",
            "optimizer/",
        ),
        (legacy_checkpoint, "MixedPrecisionOptimizer, DynamicLossScaler", "optimizer.pt"),
    ],
    ids=["reshardable", "legacy"],
)
def test_inspect_prints_counters_and_scale(tmp_path, capsys, save, optimizer, file):
    engine = build("fp16")
    train(engine, 2)
    save(engine, tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert (
        re.search(r"^global_step +2$", text, re.M)
        and re.search(r"^optimizer +(.*)$", text, re.M)[1] == optimizer
    )
    assert "file model.safetensors" in text and f"file {file}" in text
    assert f"{engine.optimizer.loss_scale:g}" in text


def _cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_errors_are_messages_with_the_cli_hint(tmp_path, capsys):
    engine = build("bf16")
    train(engine, 1)
    engine.save_checkpoint(tmp_path / "ck", tag="a")
    (tmp_path / "ck" / "latest").unlink()
    code, out, err = _cli(["inspect", str(tmp_path / "ck")], capsys)
    assert code == 2 and out == ""
    assert err.startswith("halfprec inspect: error: no checkpoint in ") and "pass --tag with one of: a" in err
    assert "tag=" not in err and "Traceback" not in err
    assert _cli(["inspect", str(tmp_path / "ck"), "--tag", "a"], capsys)[0] == 0

    code, _, err = _cli(
        ["export", str(tmp_path / "ck"), "--tag", "a b", "--out", str(tmp_path / "x")], capsys
    )
    assert code == 2 and "halfprec export: error: invalid checkpoint tag 'a b'" in err
    code, _, err = _cli(["export", str(tmp_path / "none"), "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "the directory does not exist" in err

    target = tmp_path / "ck" / "a" / "optimizer" / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(data)
    out_file = tmp_path / "x.safetensors"
    code, _, err = _cli(["export", str(tmp_path / "ck"), "--tag", "a", "--out", str(out_file)], capsys)
    assert code == 2 and f"{target} is corrupted" in err and not out_file.exists()


def _dcp_checkpoint(path):
    """A ZeRO-style optimizer checkpoint (``halfprec.distributed.checkpoint.save``), written without a group."""
    from halfprec import MixedPrecisionOptimizer
    from halfprec.distributed import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).bfloat16()
    mp = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.25))
    mp.backward(model(torch.ones(4, 3, dtype=torch.bfloat16)).float().sum())
    mp.step()
    checkpoint.save(mp, path, named_parameters=model)


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_export_to_a_directory_is_one_line_and_leaves_nothing(tmp_path, capsys):
    engine = build("bf16")
    train(engine, 1)
    engine.save_checkpoint(tmp_path / "ck")
    (tmp_path / "dir").mkdir()
    before = _listing(tmp_path)
    code, out, err = _cli(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "dir")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"halfprec export: error: cannot write the weights to {tmp_path / 'dir'}: it is a directory"
    )
    assert str(tmp_path / "dir" / "model.safetensors") in err
    assert _listing(tmp_path) == before


def test_inspect_and_export_read_a_dcp_checkpoint(tmp_path, capsys):
    _dcp_checkpoint(tmp_path / "zero")
    code, out, err = _cli(["inspect", str(tmp_path / "zero")], capsys)
    assert code == 0 and err == "", err
    assert "halfprec DCP optimizer checkpoint, version 1" in out and "group 0 lr" in out and "0.25" in out
    assert "master params" in out and "file .metadata" in out
    assert _cli(["export", str(tmp_path / "zero"), "--out", str(tmp_path / "w.safetensors")], capsys)[0] == 0
    assert sorted(load_file(str(tmp_path / "w.safetensors"))) == ["bias", "weight"]
    (tmp_path / "zero" / "manifest.json").unlink()  # as written before DCP checkpoints had a manifest
    code, out, _ = _cli(["inspect", str(tmp_path / "zero")], capsys)
    assert code == 0 and "halfprec DCP optimizer checkpoint" in out


def test_a_file_where_a_checkpoint_directory_is_expected_is_named(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    for command in (["inspect"], ["export", "--out", str(tmp_path / "o.safetensors")]):
        code, out, err = _cli([*command[:1], str(tmp_path / "model.safetensors"), *command[1:]], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert "model.safetensors: it is a file, not a checkpoint directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_every_export_option_has_help(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    assert "dtype of the written floating-point tensors" in text and "output .safetensors file" in text
