"""`import halfprec` initialises no CUDA and imports no Triton; the public surface is pinned."""

import subprocess
import sys

import halfprec

PUBLIC = [
    "Config",
    "DeepSpeedConfigWarning",
    "DynamicLossScaler",
    "Engine",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "StaticLossScaler",
    "StepRecord",
    "__version__",
    "initialize",
]


def test_public_surface_is_pinned():
    assert sorted(halfprec.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(halfprec, name), name


def test_import_touches_no_cuda_and_no_triton():
    code = (
        "import sys, torch, halfprec, halfprec.optim, halfprec.integrations, halfprec.distributed\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not torch.cuda.is_initialized(), 'cuda initialised'\n"
        "for tool in ('lightning', 'transformers', 'accelerate'):\n"
        "    assert tool not in sys.modules, tool\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
