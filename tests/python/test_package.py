"""pip install . into a venv that sees Debian's packages, without the
network, as docs/client-library.md says."""
import os
import subprocess
import sys

import pytest

from conftest import BIN_DIR

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_pip_install_into_a_venv(tmp_path):
    try:
        import ensurepip  # noqa: F401  (Debian: python3-venv)
    except ImportError:
        pytest.skip("python3-venv is not installed")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = dict(os.environ, PSTRAIN_BUILD_DIR=os.path.dirname(os.path.abspath(BIN_DIR)))
    env.pop("PYTHONPATH", None)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-build-isolation", "--no-index",
                    REPO], check=True, env=env, cwd=tmp_path)
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import pstrain, pstrain.torch; print(pstrain.__file__, pstrain.copied_payload_bytes())"],
        check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    where, copied = imported.stdout.split()
    assert where.startswith(str(venv)), where
    assert copied == "0"
