"""The committed protocol code is what proto/ generates."""

import os
import subprocess
import sys


def test_generated_code_is_up_to_date():
    here = os.path.join(os.path.dirname(__file__), "..")
    result = subprocess.run(["bash", os.path.join(here, "generate.sh"), "--check"], env={**os.environ, "PYTHON": sys.executable},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
