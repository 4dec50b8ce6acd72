"""The DeepSpeed config mapping (``halfprec.deepspeed_config``): real configs from DeepSpeed's docs and examples,
key semantics, the key table and its docs page."""

import json
import re
import warnings
from pathlib import Path

import pytest

from halfprec.config import Config
from halfprec.deepspeed_config import DEEPSPEED_KEYS, DeepSpeedConfigWarning, render_deepspeed_table

DATA = Path(__file__).parent / "data" / "deepspeed"
DOCS = Path(__file__).parents[1] / "docs" / "deepspeed-config.md"


def _read(cfg):
    """from_deepspeed, returning the Config and the text of its one warning ('' when none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = Config.from_deepspeed(cfg)
    ours = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(ours) <= 1, [str(w.message) for w in ours]
    assert len(caught) == len(ours), [str(w.message) for w in caught]
    return config, (str(ours[0].message) if ours else "")


def test_deepspeed_reader_does_not_import_config():
    """The config <-> deepspeed_config cycle stays open: the reader is handed the Config class."""
    import ast

    import halfprec.deepspeed_config as ds

    tree = ast.parse(Path(ds.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "config" not in imported and not any(m and m.endswith(".config") for m in imported)


# --- DeepSpeed fixtures --------------------------------------------------------------------------------

FP16_DYNAMIC = {
    "precision": "fp16",
    "static_loss_scale": None,
    "initial_scale": 2.0**16,
    "growth_interval": 1000,
}
FIXTURES = [
    (
        "deepspeed_docs_config_json_fp16.json",
        dict(FP16_DYNAMIC, hysteresis=2, min_scale=1.0, max_grad_norm=1.0),
        [],
    ),
    (
        "deepspeedexamples_autotuning_fp16_zero1.json",
        dict(FP16_DYNAMIC, zero_stage=1),
        ["train_micro_batch_size_per_gpu"],
    ),
    (
        "deepspeedexamples_megatron_fp16_zero2.json",
        dict(FP16_DYNAMIC, zero_stage=2, max_grad_norm=1.0, gradient_accumulation_steps=1),
        [
            "train_batch_size",
            "steps_per_print",
            "optimizer",
            "activation_checkpointing",
            "wall_clock_breakdown",
        ],
    ),
    (
        "deepspeedexamples_llama7b_bf16_zero2.json",
        {"precision": "bf16", "zero_stage": 2, "max_grad_norm": 1.0, "gradient_accumulation_steps": 4},
        [
            "zero_optimization.overlap_comm=True",
            "zero_optimization.reduce_bucket_size=500000000",
            "scheduler",
        ],
    ),
    (
        "deepspeedexamples_autoep_bf16_zero1.json",
        {"precision": "bf16", "zero_stage": 1, "max_grad_norm": None, "gradient_accumulation_steps": 1},
        ["expert_parallel", "optimizer", "scheduler", "train_micro_batch_size_per_gpu", "steps_per_print"],
    ),
    (
        "deepspeedexamples_hf_tp_bf16_auto.json",
        {"precision": "bf16", "zero_stage": 2, "max_grad_norm": None, "gradient_accumulation_steps": 1},
        [
            "bf16.enabled = 'auto': halfprec's default precision='bf16'",
            "gradient_clipping='auto': halfprec's default max_grad_norm=None",
            "gradient_accumulation_steps='auto': halfprec's default gradient_accumulation_steps=1",
            "zero_optimization.gather_16bit_weights_on_model_save=True: accepted, not applied (ZeRO-3 only",
            "tensor_parallel",
        ],
    ),
]


@pytest.mark.parametrize(("name", "expected", "warned"), FIXTURES, ids=[f[0] for f in FIXTURES])
def test_fixture_maps(name, expected, warned):
    config, message = _read(DATA / name)
    for field, value in expected.items():
        assert getattr(config, field) == value, field
    assert _read(json.loads((DATA / name).read_text())) == (config, message)  # a path reads like its dict
    for text in warned:
        assert text in message, (text, message)
    if not warned:
        assert message == ""


def test_fixture_warning_lists_every_unowned_top_level_key_once():
    cfg = json.loads((DATA / "deepspeedexamples_llama7b_bf16_zero2.json").read_text())
    _, message = _read(cfg)
    line = [ln for ln in message.splitlines() if "top-level keys halfprec does not own" in ln]
    assert len(line) == 1
    listed = line[0].split("not applied: ")[1].split(", ")
    assert listed == [
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "steps_per_print",
        "wall_clock_breakdown",
        "optimizer",
        "scheduler",
    ]


ERROR_FIXTURES = [
    (
        "deepspeedexamples_cifar_fp16_zero2_cpu_offload.json",
        r"fp16\.fp16_master_weights_and_grads=True.*zero_optimization\.cpu_offload=True",
    ),
    (
        "transformers_zero2_auto_cpu_offload.json",
        r"zero_optimization\.offload_optimizer=.*'cpu'.*does not offload",
    ),
    (
        "transformers_zero3_fp16.json",
        r"zero_optimization\.offload_optimizer=.*'cpu'.*does not offload.*zero_optimization\.offload_param=",
    ),
]


@pytest.mark.parametrize(("name", "regex"), ERROR_FIXTURES, ids=[f[0] for f in ERROR_FIXTURES])
def test_fixture_refused(name, regex):
    with pytest.raises(ValueError, match=regex):
        Config.from_deepspeed(DATA / name)


def test_transformers_zero2_without_offload_maps_with_auto_precision():
    cfg = json.loads((DATA / "transformers_zero2_auto_cpu_offload.json").read_text())
    del cfg["zero_optimization"]["offload_optimizer"]
    config, message = _read(cfg)
    assert (config.precision, config.zero_stage, config.max_grad_norm) == ("bf16", 2, None)
    assert "fp16.enabled and bf16.enabled = 'auto': halfprec's default precision='bf16'" in message
    assert "so these were not applied: fp16.loss_scale, fp16.loss_scale_window" in message
    for knob in (
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "reduce_scatter",
        "reduce_bucket_size",
        "contiguous_gradients",
    ):
        assert f"zero_optimization.{knob}=" in message


def test_transformers_zero3_without_offload_maps_to_fsdp2():
    cfg = json.loads((DATA / "transformers_zero3_fp16.json").read_text())
    del cfg["zero_optimization"]["offload_optimizer"], cfg["zero_optimization"]["offload_param"]
    config, message = _read(cfg)
    assert (config.precision, config.zero_stage) == ("fp16", 3)
    assert (
        "zero_optimization.stage3_max_live_parameters=1000000000.0: accepted, not applied (ZeRO-3 only"
        in message
    )


# --- DeepSpeed key semantics ---------------------------------------------------------------------------

MAPPED = [
    ({}, {"precision": "fp32", "max_grad_norm": None, "zero_stage": 0}),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, {"precision": "fp16", "static_loss_scale": None}),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, {"static_loss_scale": 128.0}),
    ({"fp16": {"enabled": True, "initial_scale_power": 12}}, {"initial_scale": 4096.0}),
    (
        {"fp16": {"enabled": True, "loss_scale_window": 50, "hysteresis": 1}},
        {"growth_interval": 50, "hysteresis": 1},
    ),
    ({"fp16": {"enabled": True, "min_loss_scale": 4}}, {"min_scale": 4.0}),
    ({"bfloat16": {"enabled": True}}, {"precision": "bf16"}),
    ({"bf16": {"enabled": True, "check_grad_overflow": False}}, {"skip_nonfinite": False}),
    ({"bf16": {"enabled": True, "check_grad_overflow": True}}, {"skip_nonfinite": True}),
    ({"gradient_clipping": 0}, {"max_grad_norm": None}),
    ({"gradient_clipping": 0.5}, {"max_grad_norm": 0.5}),
    ({"gradient_accumulation_steps": 16}, {"gradient_accumulation_steps": 16}),
    ({"zero_optimization": {"stage": 0}}, {"zero_stage": 0}),
    ({"zero_optimization": {"stage": 3}}, {"zero_stage": 3}),  # fully_shard inside initialize
    ({"bf16": {"enabled": True}, "communication_data_type": "bf16"}, {"reduce_dtype": "param"}),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp32"}, {"reduce_dtype": "fp32"}),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, {"grad_accum_dtype": "fp32"}),
    ({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}, {"grad_accum_dtype": "param"}),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": None}}, {"grad_accum_dtype": "auto"}),
    (
        {
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {"stage": 2},
        },
        {"grad_accum_dtype": "fp32", "zero_stage": 2, "reduce_dtype": "fp32"},
    ),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}}, {"zero_stage": 1}),
    ({"fp16": {"enabled": True, "auto_cast": False, "consecutive_hysteresis": False}}, {"precision": "fp16"}),
    ({"fp16": {"enabled": True, "auto_cast": True}}, {"precision": "fp16"}),
]


@pytest.mark.parametrize(("cfg", "expected"), MAPPED)
def test_keys_map_silently(cfg, expected):
    config, message = _read(cfg)
    assert message == ""
    assert {k: getattr(config, k) for k in expected} == expected


def test_min_loss_scale_rounded_up_with_warning():
    config, message = _read({"fp16": {"enabled": True, "min_loss_scale": 1e-10}})
    assert config.min_scale == 2.0**-33 and 2.0**-34 < 1e-10 < 2.0**-33
    assert "fp16.min_loss_scale=1e-10 is not a power of two; rounded up to 1.16" in message
    config, message = _read({"fp16": {"enabled": True, "min_loss_scale": 3}})
    assert config.min_scale == 4.0 and "rounded up to 4.0" in message


def test_fp16_auto_alone_means_bf16():
    config, message = _read({"fp16": {"enabled": "auto", "loss_scale": 0}})
    assert config.precision == "bf16"
    assert "fp16.enabled = 'auto': halfprec's default precision='bf16'" in message
    assert "these were not applied: fp16.loss_scale" in message


def test_bf16_block_keys_not_applied_under_fp16_are_reported():
    config, message = _read(
        {"fp16": {"enabled": True}, "bf16": {"enabled": False, "check_grad_overflow": False}}
    )
    assert config.skip_nonfinite is True
    assert "precision is 'fp16', so these were not applied: bf16.check_grad_overflow" in message


def test_deprecated_boolean_zero_optimization():
    config, message = _read({"zero_optimization": True})
    assert config.zero_stage == 1 and "deprecated form; read as stage 1" in message


def test_performance_knobs_and_flags_warn_in_one_message():
    cfg = {
        "fp16": {"enabled": True, "auto_cast": "yes", "consecutive_hysteresis": True},
        "bf16": {"immediate_grad_update": True},
        "zero_optimization": {"stage": 2, "round_robin_gradients": True, "stage3_max_live_parameters": 1e9},
        "steps_per_print": 10,
        "tensorboard": {"enabled": True},
    }
    _, message = _read(cfg)
    for text in (
        "fp16.auto_cast='yes': accepted, not applied (the engine casts floating inputs to the model dtype either way",
        "fp16.consecutive_hysteresis=True: accepted, not applied",
        "bf16.immediate_grad_update=True",
        "zero_optimization.round_robin_gradients=True",
        "zero_optimization.stage3_max_live_parameters=1000000000.0: accepted, not applied (ZeRO-3 only",
        "top-level keys halfprec does not own, not applied: steps_per_print, tensorboard",
    ):
        assert text in message, text


def test_from_deepspeed_result_is_validated_like_config():
    config, _ = _read({"fp16": {"enabled": True, "loss_scale": 256}, "gradient_accumulation_steps": 2})
    assert config == Config(precision="fp16", static_loss_scale=256.0, gradient_accumulation_steps=2)


DS_ERRORS = [
    (
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        r"both fp16\.enabled and bf16\.enabled are true",
    ),
    (
        {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
        r"both 'bf16' and its legacy name 'bfloat16'",
    ),
    ({"fp16": {"enabled": "yes"}}, r"fp16\.enabled must be true, false or 'auto', got 'yes'"),
    ({"fp16": {"enabled": 1}}, r"fp16\.enabled must be true, false or 'auto', got 1"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": False}}, r"'auto' means halfprec's default \(bf16\)"),
    (
        {"fp16": {"enabled": True, "loss_scale": 1000}},
        r"static_loss_scale must be a power of two.*fp16\.loss_scale",
    ),
    (
        {"fp16": {"enabled": True, "loss_scale": -1}},
        r"fp16\.loss_scale must be 0 \(dynamic\) or a power of two",
    ),
    (
        {"fp16": {"enabled": True, "initial_scale_power": 16.5}},
        r"fp16\.initial_scale_power must be an integer",
    ),
    (
        {"fp16": {"enabled": True, "initial_scale_power": 2000}},
        r"fp16\.initial_scale_power must be an integer",
    ),
    (
        {"fp16": {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 2}},
        r"initial_scale \(1\.0\).*min_scale",
    ),
    (
        {"fp16": {"enabled": True, "loss_scale_window": 0}},
        r"growth_interval must be .*fp16\.loss_scale_window",
    ),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, r"hysteresis must be an integer >= 1.*fp16\.hysteresis"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, r"fp16\.min_loss_scale must be a finite number > 0"),
    (
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        r"fp16_master_weights_and_grads=True",
    ),
    (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        r"bf16_master_weights_and_grads=True",
    ),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, r"bf16_optimizer_states=True"),
    ({"gradient_clipping": -1.0}, r"gradient_clipping must be a finite number >= 0 \(0 = no clipping\)"),
    (
        {"gradient_accumulation_steps": 0},
        r"gradient_accumulation_steps must be an integer >= 1.*from DeepSpeed",
    ),
    (
        {"zero_optimization": {"stage": 5}},
        r"zero_stage must be one of 0, 1, 2, 3, got 5 \(from DeepSpeed zero_opt",
    ),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, r"offload_param=.*nvme.*does not offload"),
    ({"zero_optimization": {"cpu_offload_param": True}}, r"cpu_offload_param=True"),
    ({"zero_optimization": {"zenflow": {"topk_ratio": 0.05}}}, r"zenflow="),
    (
        {"fp16": {"enabled": True}, "communication_data_type": "bf16"},
        r"communication_data_type='bf16'.*'fp32' or 'fp16'",
    ),
    (
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
        r"data_types\.grad_accum_dtype='fp16' with precision='bf16': .*use 'fp32' or 'bf16'",
    ),
    (
        {"data_types": {"grad_accum_dtype": "float16"}},
        r"data_types\.grad_accum_dtype='float16' with precision='fp32'.*use 'fp32'$",
    ),
    (
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": 32}},
        r"data_types\.grad_accum_dtype=32 with precision='bf16'",
    ),
    (
        {
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "bf16",
            "zero_optimization": {"stage": 1},
        },
        r"grad_accum_dtype='fp32' with reduce_dtype='param' at zero_stage=1.*\(from DeepSpeed .*"
        r"data_types\.grad_accum_dtype",
    ),
    (
        {"data_types": {"grad_acum_dtype": "fp32"}},
        r"data_types\.grad_acum_dtype \(did you mean 'data_types\.grad_accum_dtype'",
    ),
    ({"data_types": "fp32"}, r"DeepSpeed 'data_types' must be a dict, got 'fp32'"),
    ({"fp16": True}, r"DeepSpeed 'fp16' must be a dict, got True"),
    ([("fp16", {})], r"a DeepSpeed config is a dict"),
    (
        {"train_batch_size": 8, 1: "x"},
        r"^the DeepSpeed config has the int key 1; DeepSpeed config keys are strings, as in JSON: write it as '1' "
        r"or remove it$",
    ),
    ({"fp16": {"enabled": True, 2.0: 1}}, r"^DeepSpeed 'fp16' has the float key 2\.0; .*write it as '2\.0'"),
]


@pytest.mark.parametrize(("cfg", "regex"), DS_ERRORS)
def test_deepspeed_errors(cfg, regex):
    with pytest.raises(ValueError, match=regex):
        Config.from_deepspeed(cfg)


# (the file's text, error, message): a config file that is not JSON, named with the place to fix
FILE_ERRORS = [
    (
        '{"fp16": {"enabled": true,}}',
        ValueError,
        r"^DeepSpeed config .*ds\.json is not valid JSON: Expecting property name enclosed in double quotes at "
        r"line 1 column 27; fix the file there \(JSON has no comments and no trailing commas\)$",
    ),
    (
        '{\n  "fp16": {"enabled": true} // fp16\n}',
        ValueError,
        r"ds\.json is not valid JSON: Expecting .,. delimiter at line 2 column 29;",
    ),
    ("", ValueError, r"ds\.json is not valid JSON: Expecting value at line 1 column 1;"),
]


@pytest.mark.parametrize(("text", "error", "regex"), FILE_ERRORS, ids=["trailing-comma", "comment", "empty"])
def test_deepspeed_file_errors(tmp_path, text, error, regex):
    (tmp_path / "ds.json").write_text(text)
    with pytest.raises(error, match=regex):
        Config.from_deepspeed(tmp_path / "ds.json")
    with pytest.raises(error, match=regex):
        Config.from_deepspeed(str(tmp_path / "ds.json"))


def test_unknown_keys_are_listed_with_suggestions():
    cfg = {
        "fp16": {"enabled": True, "loss_scale_windw": 100},
        "bf16": {"bogus": 1},
        "zero_optimization": {"stage": 1, "overlap_com": True},
        "made_up_top_level": 1,  # not halfprec's: warned, never an error
    }
    with pytest.raises(ValueError) as info:
        Config.from_deepspeed(cfg)
    msg = str(info.value)
    assert "fp16.loss_scale_windw (did you mean 'fp16.loss_scale_window'?)" in msg
    assert "zero_optimization.overlap_com (did you mean 'zero_optimization.overlap_comm'?)" in msg
    assert re.search(r"bf16\.bogus(;|\.| )", msg)
    assert "made_up_top_level" not in msg


# --- the key table -------------------------------------------------------------------------------------


def test_key_table_is_well_formed():
    keys = [row.key for row in DEEPSPEED_KEYS]
    assert len(keys) == len(set(keys))
    for row in DEEPSPEED_KEYS:
        assert row.action in ("mapped", "warn", "error") and row.target
        assert row.key.split(".")[0] in (
            "fp16",
            "bf16",
            "zero_optimization",
            "gradient_clipping",
            "gradient_accumulation_steps",
            "communication_data_type",
            "data_types",
        )
        if row.action == "error":
            assert row.quiet is not None and row.quiet_text, row.key  # an error row says how to satisfy it


def test_every_warn_row_is_accepted_and_reported():
    for row in DEEPSPEED_KEYS:
        if row.action != "warn":
            continue
        block, key = row.key.split(".")
        _, message = _read({block: {key: 12345}})
        assert f"{row.key}=12345: accepted, not applied" in message, row.key


def test_docs_table_matches_code():
    assert render_deepspeed_table() in DOCS.read_text()


def test_auto_beside_an_explicit_precision_is_reported():
    with pytest.warns(DeepSpeedConfigWarning, match=r"bf16.enabled=.auto. with fp16.enabled=true"):
        config = Config.from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": "auto"}})
    assert config.precision == "fp16"


@pytest.mark.parametrize(
    ("where", "regex"),
    [
        (
            "missing.json",
            r"DeepSpeed config '.*missing\.json' does not exist: pass the path of the JSON file",
        ),
        (".", r"DeepSpeed config '.*' is not a file \(it is a directory\): pass the path"),
        ('{"fp16": {"enabled": true}}', r"does not exist: it looks like JSON text; pass json\.loads\(text\)"),
    ],
)
def test_a_config_path_that_is_not_a_file_names_the_fix(tmp_path, monkeypatch, where, regex):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=regex):
        Config.from_deepspeed(where)


def test_a_stage_3_config_shards_the_model_in_initialize_and_trains(tmp_path):
    """A DeepSpeed config with ZeRO stage 3, through ``initialize``: the engine applies ``fully_shard`` by its
    default policy (each block, then the root), casts the shards to bf16, keeps fp32 masters of each rank's rows,
    and steps (a one-rank gloo world)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    import halfprec
    from halfprec.optim.mesh import is_dtensor

    from .optim.helpers import world_of_one

    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}
    with world_of_one(tmp_path / "store"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
        fp32 = [p.detach().clone() for p in model.parameters()]
        engine = halfprec.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=Config.from_deepspeed(ds)
        )
        assert [n for n, m in engine.module.named_modules() if isinstance(m, FSDPModule)] == ["", "0", "2"]
        assert all(is_dtensor(p) and p.dtype == torch.bfloat16 for p in engine.module.parameters())
        masters = engine.optimizer.master_params()
        assert all(m.dtype == torch.float32 for m in masters)
        assert all(torch.equal(m, w) for m, w in zip(masters, fp32, strict=True))  # from the fp32 weights
        x, y = torch.randn(4, 6), torch.randn(4, 3)
        engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
        assert not engine.optimizer.step_was_skipped and engine.optimizer.max_grad_norm == 1.0
        assert not any(torch.equal(m, w) for m, w in zip(masters, fp32, strict=True))
