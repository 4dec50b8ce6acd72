"""``import halfprec.integrations`` must not import any of the tools (they are optional extras)."""

import subprocess
import sys


def test_integrations_package_imports_no_tool():
    code = (
        "import sys, halfprec.integrations; "
        "loaded = [m for m in ('lightning', 'transformers', 'accelerate', 'pytorch_lightning') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
