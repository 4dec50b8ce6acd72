"""The names that key checkpoints: a model's own names, without torch.compile's ``_orig_mod`` components (the
round trips across compiled and eager models are in tests/test_compile.py)."""

from __future__ import annotations

import pytest
import torch

from halfprec.optim.names import clean_keys, clean_name, named_trainable


@pytest.mark.parametrize(
    "name, clean",
    [
        ("0.weight", "0.weight"),
        ("_orig_mod.0.weight", "0.weight"),  # torch.compile(model)
        ("layers.1._orig_mod.attn.weight", "layers.1.attn.weight"),  # a compiled submodule
        ("_orig_mod.layers.1._orig_mod.bias", "layers.1.bias"),  # both
        ("my_orig_mod.w", "my_orig_mod.w"),  # a component, not text: str.replace would give "myw"
        ("_orig_mod_x.w", "_orig_mod_x.w"),
        ("bias", "bias"),
    ],
)
def test_clean_name_drops_the_compiled_modules_components(name, clean):
    assert clean_name(name) == clean


def test_clean_names_are_torchs_own():
    """torch.distributed.checkpoint's model state dict keys a compiled model by the names we clean to."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415

    inner = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    inner[2] = torch.compile(inner[2], backend="eager")
    model = torch.compile(inner, backend="eager")
    assert list(model.state_dict())[0] == "_orig_mod.0.weight"
    assert list(get_model_state_dict(model)) == [clean_name(n) for n in model.state_dict()]
    assert "2.weight" in get_model_state_dict(model)


def test_clean_keys_keeps_order_and_values_and_refuses_two_names_for_one():
    a, b = torch.zeros(1), torch.ones(1)
    out = clean_keys({"_orig_mod.b": b, "_orig_mod.a": a})
    assert list(out) == ["b", "a"] and out["a"] is a and out["b"] is b
    with pytest.raises(ValueError, match=r"the params '_orig_mod\.a' and 'a' are both named 'a'"):
        clean_keys({"_orig_mod.a": a, "a": b}, what="params")


def test_named_trainable_names_a_compiled_model_as_the_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD([{"params": model[2].parameters()}, {"params": model[0].parameters()}], lr=0.1)
    names, params, groups = named_trainable(opt, compiled)
    assert names == ["2.weight", "2.bias", "0.weight"]  # the frozen bias left out
    assert params == [model[2].weight, model[2].bias, model[0].weight] and groups == [0, 0, 1]
    assert named_trainable(opt, model)[0] == names
    assert named_trainable(opt, compiled.named_parameters())[0] == names


@pytest.mark.parametrize(
    "pairs, message",
    [
        ("two", r"the params '_orig_mod\.w' and 'w' are both named 'w'"),
        ("not_pairs", "an nn.Module or an iterable of \\(name, param\\) pairs"),
        ("missing", "has no name in named_parameters"),
    ],
)
def test_named_trainable_refusals(pairs, message):
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p, q], lr=0.1)
    given = {
        "two": [("_orig_mod.w", p), ("w", q)],
        "not_pairs": [p, q],
        "missing": [("w", p)],
    }[pairs]
    with pytest.raises(ValueError, match=message):
        named_trainable(opt, given)
