"""Config validation (``halfprec.config``): fields, aliases, the scaler it builds, replace()."""

from pathlib import Path

import pytest

from halfprec.config import OLD_NAMES, Config, config_name, dynamic_scaling

DATA = Path(__file__).parent / "data" / "deepspeed"
DOCS = Path(__file__).parents[1] / "docs" / "deepspeed-config.md"


# --- Config validation ---------------------------------------------------------------------------------

VALID = [
    {},
    {"precision": "fp16", "static_loss_scale": 1024.0},
    {"precision": "bf16", "static_loss_scale": 1.0},
    {"precision": "fp32", "max_grad_norm": 0.5, "gradient_accumulation_steps": 8},
    {"precision": "fp16", "initial_scale": 2.0**-3, "min_scale": 2.0**-10, "growth_factor": 4.0},
    {"zero_stage": 2, "reduce_dtype": "param", "impl": "triton", "skip_nonfinite": False},
    {"precision": "fp16", "grad_accum_dtype": "fp32", "impl": "triton"},  # fp32 accumulation, fused path
    {"precision": "bf16", "grad_accum_dtype": "fp32"},  # impl="auto": either path
    {"precision": "bf16", "grad_accum_dtype": "fp32", "zero_stage": 2},  # fp32 buffer, fp32 reduce-scatter
    {"grad_accum_dtype": "fp32", "reduce_dtype": "param"},  # stage 0: reduce_dtype is not used
    {"zero_stage": 3, "precision": "fp16"},  # fully_shard inside initialize
    {"zero_stage": 3, "impl": "triton", "masters": "split"},  # the fused strategy over the shards
    # FSDP2 reduce-scatters in bf16, the hooks sum the reduced shards of the micro-batches in fp32
    {"zero_stage": 3, "grad_accum_dtype": "fp32", "reduce_dtype": "param"},
]


@pytest.mark.parametrize("kwargs", VALID)
def test_valid_configs_build(kwargs):
    config = Config(**kwargs)
    assert all(getattr(config, k) == v for k, v in kwargs.items())


INVALID = [
    ({"precision": "bfloat16"}, r"precision must be one of .*got 'bfloat16'; use 'bf16'"),
    ({"precision": "int8"}, r"precision must be one of 'bf16', 'fp16', 'fp32', got 'int8'$"),
    (
        {"precision": "fp16", "static_loss_scale": 1000.0},
        r"static_loss_scale must be a power of two.*1024\.0",
    ),
    ({"precision": "fp16", "static_loss_scale": 0.0}, r"static_loss_scale must be a positive, finite"),
    ({"precision": "fp16", "static_loss_scale": True}, r"static_loss_scale must be a number"),
    ({"precision": "bf16", "static_loss_scale": 128.0}, r"only for fp16.*static_loss_scale=None"),
    ({"initial_scale": 3.0}, r"initial_scale must be a power of two.*got 3\.0; use 4\.0 or 2\.0"),
    ({"initial_scale": float("inf")}, r"initial_scale must be a positive, finite power of two"),
    ({"growth_factor": 1.0}, r"growth_factor must be > 1, got 1\.0; use 2\.0"),
    ({"growth_factor": 3.0}, r"growth_factor must be a power of two"),
    ({"backoff_factor": 2.0}, r"backoff_factor must be < 1, got 2\.0; use 0\.5"),
    ({"min_scale": 0.3}, r"min_scale must be a power of two"),
    ({"initial_scale": 1.0, "min_scale": 2.0}, r"initial_scale \(1\.0\) must be >= min_scale \(2\.0\)"),
    ({"growth_interval": 0}, r"growth_interval must be an integer >= 1, got 0"),
    ({"growth_interval": 10.0}, r"growth_interval must be an integer >= 1, got 10\.0"),
    ({"hysteresis": 0}, r"hysteresis must be an integer >= 1, got 0"),
    ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps must be an integer >= 1, got 0"),
    ({"gradient_accumulation_steps": True}, r"gradient_accumulation_steps must be an integer >= 1, got True"),
    ({"max_grad_norm": 0.0}, r"max_grad_norm must be a finite number > 0, or None.*got 0\.0"),
    ({"max_grad_norm": -1.0}, r"max_grad_norm must be a finite number > 0"),
    ({"max_grad_norm": float("nan")}, r"max_grad_norm must be a finite number > 0"),
    ({"skip_nonfinite": 1}, r"skip_nonfinite must be one of True, False, got 1"),
    ({"zero_stage": 4}, r"zero_stage must be one of 0, 1, 2, 3, got 4"),
    ({"zero_stage": True}, r"zero_stage must be one of 0, 1, 2, 3, got True"),
    ({"reduce_dtype": "bf16"}, r"reduce_dtype must be one of 'fp32', 'param', got 'bf16'"),
    (
        {"grad_accum_dtype": "bf16"},
        r"grad_accum_dtype must be one of \('auto', 'param', 'fp32'\), got 'bf16'",
    ),
    ({"impl": "cuda"}, r"impl must be one of 'auto', 'torch', 'triton', got 'cuda'"),
    (
        {"grad_accum_dtype": "fp32", "zero_stage": 2, "reduce_dtype": "param"},
        r"grad_accum_dtype='fp32' with reduce_dtype='param' at zero_stage=2: .*use reduce_dtype='fp32'",
    ),
]


@pytest.mark.parametrize(("kwargs", "regex"), INVALID)
def test_invalid_configs_raise(kwargs, regex):
    with pytest.raises(ValueError, match=regex):
        Config(**kwargs)


# Values the checks above pass by type but that the loss scaler could not use: refused when the Config is built,
# under the name the caller wrote, not at the first (skipped) step.
UNUSABLE = [
    ({"initial_scale": 2.0**200}, ValueError, r"initial_scale=.* \(2\*\*200\) is inf in fp32.*2\.0\*\*127"),
    ({"init_scale": 2.0**128}, ValueError, r"init_scale=.* \(2\*\*128\) is inf in fp32"),
    ({"precision": "fp16", "static_loss_scale": 2.0**200}, ValueError, r"static_loss_scale=.*is inf in fp32"),
    ({"init_scale": 1.0, "min_scale": 2.0**-150}, ValueError, r"min_scale=.* \(2\*\*-150\) is 0 in fp32"),
    ({"growth_interval": 2**70}, ValueError, r"growth_interval=1180591620717411303424 is too large.*int64"),
    ({"hysteresis": 2**64}, ValueError, r"hysteresis=18446744073709551616 is too large"),
    ({"init_scale": 3.0}, ValueError, r"init_scale must be a power of two.*got 3\.0; use 4\.0 or 2\.0"),
    (
        {"init_scale": 4.0, "initial_scale": 8.0},
        ValueError,
        r"initial_scale is the old name of init_scale; pass only",
    ),
    ({"precision": "float16"}, ValueError, r"precision must be one of .*got 'float16'; use 'fp16'"),
    ({"initial_scal": 8.0}, TypeError, r"unexpected keyword argument 'initial_scal'"),
]


@pytest.mark.parametrize(("kwargs", "error", "regex"), UNUSABLE)
def test_unusable_scaler_settings_raise_when_built(kwargs, error, regex):
    with pytest.raises(error, match=regex):
        Config(**kwargs)


def test_old_field_name_is_an_alias():
    assert dict(OLD_NAMES) == {"initial_scale": "init_scale"}
    old = Config(precision="fp16", initial_scale=2.0**10)
    assert old == Config(precision="fp16", init_scale=2.0**10) and old.initial_scale == 2.0**10
    assert "initial_scale" not in repr(old)  # one field, shown under its name
    assert Config(init_scale=2.0**3).replace(initial_scale=2.0**5).init_scale == 2.0**5
    assert Config(initial_scale=2.0**3).replace(growth_interval=7).init_scale == 2.0**3
    with pytest.raises(ValueError, match=r"initial_scale \(1\.0\) must be >= min_scale"):
        Config(min_scale=2.0).replace(initial_scale=1.0)


def test_config_builds_the_scaler_its_fields_name():
    dynamic = Config(precision="fp16", init_scale=2.0**8, growth_interval=5, hysteresis=3, min_scale=2.0)
    assert dynamic.loss_scaler().settings() == {
        "init_scale": 256.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 5,
        "hysteresis": 3,
        "min_scale": 2.0,
    }
    static = Config(precision="fp16", static_loss_scale=8.0).loss_scaler()
    assert static.settings() == {"scale": 8.0} and config_name(static, "scale") == "static_loss_scale"
    assert config_name(dynamic.loss_scaler(), "min_scale") == "min_scale"
    assert Config(precision="bf16").loss_scaler().is_unit
    assert (
        dynamic_scaling("fp16", None)
        and not dynamic_scaling("fp16", 8.0)
        and not dynamic_scaling("bf16", None)
    )


def test_replace_validates():
    with pytest.raises(ValueError, match="hysteresis"):
        Config().replace(hysteresis=0)


@pytest.mark.parametrize(
    "changes,regex",
    [
        (
            {"gradient_accumulation": 4},
            "unknown Config field 'gradient_accumulation' \\(did you mean "
            "'gradient_accumulation_steps'\\?\\)",
        ),
        (
            {"min_scal": 2.0, "foo": 1},
            "unknown Config fields 'min_scal' \\(did you mean 'min_scale'.*\\), 'foo';",
        ),
        (
            {"foo": 1},
            "unknown Config field 'foo'; Config's fields are: precision, static_loss_scale, .*impl$",
        ),
    ],
)
def test_replace_names_unknown_fields_and_close_matches(changes, regex):
    with pytest.raises(TypeError, match=regex):
        Config().replace(**changes)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # any world size: at stage 0 across processes the optimizer all-reduces the fp32 sums itself (no DDP)
        ({"precision": "bf16", "gradient_accumulation_steps": 4}, "fp32"),
        ({"precision": "bf16", "gradient_accumulation_steps": 1}, "param"),  # nothing to sum
        (
            {"precision": "fp16", "gradient_accumulation_steps": 4},
            "param",
        ),  # the loss scale keeps 16-bit sums close
        ({"precision": "fp32", "gradient_accumulation_steps": 4}, "param"),
        ({"precision": "bf16", "gradient_accumulation_steps": 4, "zero_stage": 2}, "fp32"),
        (
            {"precision": "bf16", "gradient_accumulation_steps": 4, "zero_stage": 1, "reduce_dtype": "param"},
            "param",
        ),
        # FSDP2: the fp32 sums run over the micro-batches, after its reduce-scatter in either dtype
        (
            {"precision": "bf16", "gradient_accumulation_steps": 4, "zero_stage": 3, "reduce_dtype": "param"},
            "fp32",
        ),
        ({"precision": "bf16", "gradient_accumulation_steps": 4, "grad_accum_dtype": "param"}, "param"),
        ({"precision": "fp16", "gradient_accumulation_steps": 1, "grad_accum_dtype": "fp32"}, "fp32"),
    ],
)
def test_grad_accum_dtype_auto_resolves_like_megatron_for_bf16(fields, expected):
    assert Config(**fields).grad_accum() == expected
