"""The README's code runs as written: each ```python block, pasted into a plain script."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_usage_blocks():
    """The README shows training + validation usage and the kernel on its own."""
    blocks = _blocks()
    assert len(blocks) >= 2
    assert any("en.CenterCrop(" in b and "en.EchoRing(" in b for b in blocks)


def _block_params():
    """One parameter per block; a block that trains over the built-in 2,000-image corpus
    (an EchoRing over it) is slow (``python -m pytest -m slow``), the others are not."""
    return [pytest.param(i, marks=pytest.mark.slow) if "en.EchoRing(" in b else i
            for i, b in enumerate(_blocks())]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", _block_params())
def test_readme_block_runs_as_a_script(tmp_path, index):
    """Block ``index`` of the README, saved as train.py and run with ``python train.py``
    from another folder, exits 0 without a traceback."""
    script = tmp_path / "train.py"
    script.write_text(_blocks()[index])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=570)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
