"""The one precision vocabulary (``halfprec.precision``): names, dtypes and the errors that name the fix."""

import pytest
import torch

from halfprec import precision
from halfprec.precision import GRAD_ACCUM, check_grad_accum


def test_precision_vocabulary():
    assert precision.PRECISIONS == ("bf16", "fp16", "fp32")
    assert set(precision.LOW_PRECISION) == {torch.float16, torch.bfloat16}
    with pytest.raises(ValueError, match=r"got 'half'; use 'fp16'"):
        precision.check_precision("half")
    with pytest.raises(TypeError):
        precision.DTYPES["fp8"] = torch.float32  # read-only: one map for every module


@pytest.mark.parametrize(
    ("value", "allowed", "match"),
    [
        (
            "bfloat16",
            precision.PRECISIONS,
            r"precision must be one of 'bf16', 'fp16', 'fp32', got 'bfloat16'; use 'bf16'",
        ),
        ("float", precision.PRECISIONS, r"got 'float'; use 'fp32'"),
        (
            "fp32",
            ("bf16", "fp16"),
            r"must be one of 'bf16', 'fp16', got 'fp32'$",
        ),  # no hint to a refused name
        ("half", ("bf16",), r"got 'half'$"),  # its alias is not allowed here: no hint
        (16, precision.PRECISIONS, r"got 16$"),
        (None, precision.PRECISIONS, r"got None$"),
    ],
)
def test_check_precision_names_the_value_and_the_fix(value, allowed, match):
    with pytest.raises(ValueError, match=match):
        precision.check_precision(value, allowed=allowed)


def test_check_precision_returns_the_name_and_uses_the_callers_name():
    assert precision.check_precision("fp16") == "fp16"
    with pytest.raises(ValueError, match=r"^--precision must be"):
        precision.check_precision("x", "--precision")


def test_a_str_subclass_is_not_a_precision_name():
    class Name(str):
        pass

    with pytest.raises(ValueError, match="got 'bf16'"):
        precision.check_precision(Name("bf16"))


@pytest.mark.parametrize(
    ("value", "auto", "match"),
    [
        (None, False, r"got None; use 'param'"),
        (torch.float32, False, r"got torch.float32; use 'fp32'"),
        (torch.bfloat16, False, r"got torch.bfloat16; use 'param'"),
        ("float32", True, r"\('auto', 'param', 'fp32'\), got 'float32'; use 'fp32'"),
        ("auto", False, r"\('param', 'fp32'\), got 'auto'$"),
        ([], False, r"got \[\]$"),
    ],
)
def test_grad_accum_has_one_vocabulary_and_refuses_aliases_with_the_name(value, auto, match):
    with pytest.raises(ValueError, match=match):
        check_grad_accum(value, auto=auto)


def test_grad_accum_names_map_to_the_sum_dtype():
    assert {name: check_grad_accum(name) for name in GRAD_ACCUM} == {"param": "param", "fp32": "fp32"}
    assert GRAD_ACCUM["fp32"] is torch.float32 and GRAD_ACCUM["param"] is None
    assert check_grad_accum("auto", auto=True) == "auto"
