"""The one precision vocabulary (``halfprec.precision``): names, dtypes and the errors that name the fix."""

import pytest
import torch

from halfprec import precision


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
