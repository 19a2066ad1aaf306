"""scripts/setup-env's modes, stacks and stamps, against a fake venv whose python logs what it is asked to install.

The plain mode (``make demo``) installs the project alone; the test mode (``make test``) adds the test extra
and, on machines without GPUs, each integration's requirements for the stack (``requirements.txt`` on the default
stack, ``requirements-newest.txt`` on the newest). Each install is redone only when the file it installs from
changes; the project installs under constraints that keep the stack's torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Imports succeed unless a file `no-torch` lies beside the venv's bin/ and torch is imported; pip installs are
# logged, one line each, after PIP_CONFIG_FILE where it is set.
FAKE_PYTHON = """#!/usr/bin/env bash
venv="$(dirname "$0")/.."
if [ "$1" = -m ] && [ "$2" = pip ]; then
  echo "${PIP_CONFIG_FILE:+PIP_CONFIG_FILE=$PIP_CONFIG_FILE }${*:3}" >> "$venv/pip.log"
  [ "$5" = "torch==2.15.0" ] || [ "$5" = "torch==2.13.0" ] && rm -f "$venv/no-torch"
elif [ "$1" = -c ] && [[ "$2" == *"import torch"* ]] && [ -f "$venv/no-torch" ]; then
  exit 1
fi
exit 0
"""

PROJECT = "install -q -c .venv/.constraints.txt -e ."
PROJECT_TEST = "install -q -c .venv/.constraints.txt -e .[test]"
NEWEST_PROJECT_TEST = "PIP_CONFIG_FILE=/dev/null install -q -c .venv-newest/.constraints.txt -e .[test]"
VLLM = "install -q --no-deps -r tests/integration/vllm/requirements.txt"
MEGATRON = "install -q --no-deps -r tests/integration/megatron/requirements.txt"
MEGATRON_NEWEST = "PIP_CONFIG_FILE=/dev/null install -q --no-deps -r tests/integration/megatron/requirements-newest.txt"


def _fake_venv(tree: Path, venv: str) -> None:
    (tree / venv / "bin").mkdir(parents=True, exist_ok=True)
    (tree / venv / "bin" / "python").write_text(FAKE_PYTHON)
    (tree / venv / "bin" / "python").chmod(0o755)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the script beside a pyproject.toml, vLLM and Megatron requirements (Megatron's for both stacks) and
    fake venvs of both stacks; nvidia-smi finds no GPU, no Python 3.12 is to be found."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup-env", tmp_path / "scripts" / "setup-env")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "tests" / "integration" / "vllm").mkdir(parents=True)
    (tmp_path / "tests" / "integration" / "vllm" / "requirements.txt").write_text("a\n")
    (tmp_path / "tests" / "integration" / "megatron").mkdir(parents=True)
    (tmp_path / "tests" / "integration" / "megatron" / "requirements.txt").write_text("m\n")
    (tmp_path / "tests" / "integration" / "megatron" / "requirements-newest.txt").write_text("m2\n")
    _fake_venv(tmp_path, ".venv")
    _fake_venv(tmp_path, ".venv-newest")
    (tmp_path / "fakebin").mkdir()
    for name, text in (
        ("nvidia-smi", "#!/usr/bin/env bash\nexit 1\n"),
        ("python3.12", "#!/usr/bin/env bash\nexit 1\n"),
    ):
        (tmp_path / "fakebin" / name).write_text(text)
        (tmp_path / "fakebin" / name).chmod(0o755)
    return tmp_path


def setup_env(tree: Path, *args: str, stack: str | None = None) -> list[str]:
    """Run the script (on ``stack``, else the default); return the pip installs it made."""
    venv = tree / (".venv-newest" if stack == "newest" else ".venv")
    log = venv / "pip.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{tree / 'fakebin'}:{os.environ['PATH']}", "PYENV_ROOT": str(tree / "no-pyenv")}
    for name in ("FLUXCOMPILE_VENV", "PIP_CONFIG_FILE", "PYTHON", "STACK"):
        env.pop(name, None)
    if stack is not None:
        env["STACK"] = stack
    subprocess.run([str(tree / "scripts" / "setup-env"), *args], env=env, check=True, capture_output=True)
    return log.read_text().splitlines() if log.exists() else []


def test_plain_mode_installs_the_project_alone(tree):
    assert setup_env(tree) == [PROJECT]
    assert setup_env(tree) == []


def test_test_mode_adds_the_test_extra_vllm_and_megatron(tree):
    assert setup_env(tree) == [PROJECT]
    assert setup_env(tree, "test") == [PROJECT_TEST, MEGATRON, VLLM]
    assert setup_env(tree, "test") == []
    assert setup_env(tree) == []


def test_stamps_follow_the_files(tree):
    setup_env(tree, "test")
    (tree / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert setup_env(tree) == [PROJECT]
    assert setup_env(tree, "test") == [PROJECT_TEST]
    (tree / "tests" / "integration" / "vllm" / "requirements.txt").write_text("b\n")
    assert setup_env(tree) == []
    assert setup_env(tree, "test") == [VLLM]
    (tree / "tests" / "integration" / "megatron" / "requirements.txt").write_text("n\n")
    assert setup_env(tree) == []
    assert setup_env(tree, "test") == [MEGATRON]


def test_gpu_machine_gets_no_integrations(tree):
    (tree / "fakebin" / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 0\n")
    assert setup_env(tree, "test") == [PROJECT_TEST]
    assert setup_env(tree, "test", stack="newest") == [NEWEST_PROJECT_TEST]


def test_missing_torch_is_installed_for_the_stack(tree):
    (tree / ".venv" / "no-torch").touch()
    assert setup_env(tree) == ["install -q torch==2.13.0", PROJECT]
    (tree / ".venv-newest" / "no-torch").touch()
    assert setup_env(tree, stack="newest")[0] == "PIP_CONFIG_FILE=/dev/null install -q torch==2.15.0"


def test_newest_stack_installs_only_the_integrations_it_has_requirements_for(tree):
    assert setup_env(tree, "test", stack="newest") == [NEWEST_PROJECT_TEST, MEGATRON_NEWEST]
    assert setup_env(tree, "test", stack="newest") == []
    assert setup_env(tree, "test") == [PROJECT_TEST, MEGATRON, VLLM]  # each venv holds its own stamps
    (tree / "tests" / "integration" / "megatron" / "requirements-newest.txt").write_text("m3\n")
    assert setup_env(tree, "test") == []
    assert setup_env(tree, "test", stack="newest") == [MEGATRON_NEWEST]


def test_newest_stack_without_python_312_says_so(tree):
    shutil.rmtree(tree / ".venv-newest")
    with pytest.raises(subprocess.CalledProcessError) as e:
        setup_env(tree, "test", stack="newest")
    assert e.value.returncode == 1
    assert e.value.stderr.decode().strip().splitlines() == [
        "setup-env: the newest stack needs Python 3.12: none found (set PYTHON=/path/to/python3.12)"
    ]


def test_unknown_mode_and_stack_are_refused(tree):
    with pytest.raises(subprocess.CalledProcessError) as e:
        setup_env(tree, "tests")
    assert e.value.returncode == 2 and b"usage: [STACK=default|newest] scripts/setup-env" in e.value.stderr
    with pytest.raises(subprocess.CalledProcessError) as e:
        setup_env(tree, "test", stack="oldest")
    assert e.value.returncode == 2 and b"unknown STACK 'oldest'" in e.value.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_picks_the_mode_and_the_stack():
    # The recipes as a user's shell sees them: without the STACK or make flags of a make that runs this suite.
    env = {k: v for k, v in os.environ.items() if k not in ("STACK", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}

    def recipe(*args: str) -> str:
        return subprocess.run(
            ["make", "-n", *args], cwd=ROOT, env=env, check=True, capture_output=True, text=True
        ).stdout

    assert "STACK=default scripts/setup-env\n" in recipe("demo")
    assert "STACK=default scripts/setup-env test\n" in recipe("test")
    assert ".venv/bin/python -m pytest" in recipe("test")
    newest = recipe("test", "STACK=newest")
    assert "STACK=newest scripts/setup-env test\n" in newest and ".venv-newest/bin/python -m pytest" in newest
    assert "test STACK=newest" in recipe("test-newest")
