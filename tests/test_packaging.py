"""The installed package: only ``llmflow.*`` is importable, the console script exists, and
importing llmflow switches off torch's device-backend autoload."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def clean_env(**extra) -> dict[str, str]:
    """The environment minus anything that would put the repository on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env.update(extra)
    return env


def run_python(code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("name", ["kernels", "models", "tasks", "flows"])
def test_bare_top_level_folders_are_not_importable(name, tmp_path):
    assert tmp_path.resolve() != REPO
    result = run_python(f"import {name}", cwd=tmp_path)
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr and repr(name) in result.stderr, result.stderr


def test_llmflow_subpackages_are_importable(tmp_path):
    code = (
        "import llmflow.kernels, llmflow.models, llmflow.tasks, llmflow.flows, sys\n"
        "import llmflow.kernels.dispatch, llmflow.models.decoder\n"
        "for bare in ('kernels', 'models', 'tasks', 'flows'):\n"
        "    assert bare not in sys.modules, bare\n"
        "print(llmflow.kernels.__file__); print(llmflow.models.__file__)\n"
    )
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    kernels_file, models_file = result.stdout.split()
    assert Path(kernels_file) == REPO / "kernels" / "__init__.py"
    assert Path(models_file) == REPO / "models" / "__init__.py"


def test_console_script_help(tmp_path):
    script = Path(sys.executable).parent / "llmflow"
    assert script.is_file(), f"no console script at {script}"
    result = subprocess.run(
        [str(script), "--help"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert "usage" in out.lower() and "llmflow" in out


def test_import_llmflow_disables_backend_autoload(tmp_path):
    code = (
        "import os, sys\n"
        "assert 'TORCH_DEVICE_BACKEND_AUTOLOAD' not in os.environ\n"
        "import llmflow\n"
        "print(os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD'))\n"
        # set before torch is imported, or it would come too late to matter
        "print('torch' in sys.modules)\n"
    )
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "False"]


def test_import_llmflow_keeps_users_autoload_choice(tmp_path):
    result = run_python(
        "import os, llmflow; print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'])",
        cwd=tmp_path,
        TORCH_DEVICE_BACKEND_AUTOLOAD="1",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
