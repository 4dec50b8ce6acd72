"""`halfprec export` / `halfprec inspect`: consolidated weights from the masters, strict-loadable."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from halfprec.cli.main import main

from .engine_util import TiedLM, build, train


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


def test_inspect_prints_counters_and_scale(tmp_path, capsys):
    engine = build("fp16")
    train(engine, 2)
    engine.save_checkpoint(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert (
        "global_step" in text
        and "MixedPrecisionOptimizer, DynamicLossScaler" in text
        and "file model.safetensors" in text
    )
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

    target = tmp_path / "ck" / "a" / "optimizer.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(data)
    out_file = tmp_path / "x.safetensors"
    code, _, err = _cli(["export", str(tmp_path / "ck"), "--tag", "a", "--out", str(out_file)], capsys)
    assert code == 2 and f"{target} is corrupted" in err and not out_file.exists()
