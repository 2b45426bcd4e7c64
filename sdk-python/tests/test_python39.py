"""The package runs on the oldest Python that pyproject.toml's `requires-python` admits: its
source (the generated protocol code and the example operator included) uses no syntax, module,
function or keyword argument newer than that, as `vermin` (pinned in scripts/venv.sh) finds.
Annotations count as evaluated at run time, as they are without `from __future__ import
annotations`, and `X | Y` unions are looked for (vermin's union-types feature)."""

import os
import re
import subprocess
import sys

SDK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _oldest_python():
    with open(os.path.join(SDK, "pyproject.toml")) as f:
        found = re.search(r'^requires-python = ">=(\d+\.\d+)"$', f.read(), re.MULTILINE)
    assert found, "pyproject.toml has no requires-python = \">=X.Y\""
    return found.group(1)


def _vermin(*paths):
    vermin = os.path.join(os.path.dirname(sys.executable), "vermin")
    args = [vermin, f"--target={_oldest_python()}-", "--no-tips", "--violations", "--eval-annotations",
            "--feature", "union-types", *paths]
    return subprocess.run(args, cwd=SDK, capture_output=True, text=True)


def test_the_package_uses_nothing_newer_than_requires_python():
    assert _oldest_python() == "3.9"
    result = _vermin("capstan", "examples")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_finds_what_python_3_9_lacks(tmp_path):
    # One of each kind: syntax, a keyword argument, a module's function, an annotation.
    for source in [
        "match x:\n    case 1:\n        pass\n",
        "pairs = list(zip([1], [2], strict=True))\n",
        "import asyncio\n\nasync def f():\n    async with asyncio.timeout(1):\n        pass\n",
        "def f(x: int | None):\n    return x\n",
    ]:
        path = tmp_path / "newer.py"
        path.write_text(source)
        result = _vermin(str(path))
        assert result.returncode != 0, f"not found:\n{source}\n{result.stdout}"


def test_the_classifiers_name_every_python_from_requires_python_to_3_13():
    with open(os.path.join(SDK, "pyproject.toml")) as f:
        text = f.read()
    oldest = int(_oldest_python().split(".")[1])
    named = sorted(int(m) for m in re.findall(r'"Programming Language :: Python :: 3\.(\d+)"', text))
    assert named == list(range(oldest, 14))
