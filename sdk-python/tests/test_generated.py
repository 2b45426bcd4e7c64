"""The committed protocol code is what proto/ generates (with generate.sh's pinned generator,
in a venv of its own)."""

import os
import subprocess


def test_generated_code_is_up_to_date():
    here = os.path.join(os.path.dirname(__file__), "..")
    result = subprocess.run(["bash", os.path.join(here, "generate.sh"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
