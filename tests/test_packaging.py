"""`pip install .` (not editable) into a fresh virtual environment, then `hp-tool` from another directory.

The venv sees this machine's site-packages for the dependencies (torch, hydra, ... are installed
already and there is no network for a second copy) but gets its own, non-editable hp_tool: the test
checks that the hp_tool it imports is the venv's, that its configs came with it, and that no top-level
`main` module was installed.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", "results", "__pycache__", "*.egg-info", "build", "multirun", ".pytest_cache")


@pytest.mark.e2e
@pytest.mark.slow
def test_non_editable_install_runs_hp_tool_from_another_directory(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=SKIP)  # building writes build/ and egg-info beside the sources
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py, hp_tool = venv / "bin" / "python", venv / "bin" / "hp-tool"
    install = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(source)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(py), "-c", "import hp_tool; print(hp_tool.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    no_main = subprocess.run([str(py), "-c", "import main"], cwd=elsewhere, capture_output=True, text=True)
    assert "No module named 'main'" in no_main.stderr

    files = subprocess.run([str(py), "-m", "pip", "show", "-f", "hp_tool"], cwd=elsewhere,
                           capture_output=True, text=True, check=True).stdout
    assert "hp_tool/conf/gpu/h100_80gb.yaml" in files and "hp_tool/conf/search_config/gpt3/5b.yaml" in files
    assert "hp_tool/hf_configs/llama2_7b/config.json" in files  # the fine-tuning presets' models
    assert not any(line.strip() == "main.py" for line in files.splitlines())

    proc = subprocess.run([str(hp_tool), "search_config=gpt3/5b", "dry_run=true"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Model size: 5.05B parameters" in proc.stdout
    assert (elsewhere / "results" / "gpt3" / "5b" / "candidate_configs" / "plan.csv").is_file()
    tune = subprocess.run([str(hp_tool), "search_config=finetune/llama2_7b", "dry_run=true"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=300)
    assert tune.returncode == 0 and "Fine-tuning llama2_7b (llama, 6.74B parameters" in tune.stdout, tune.stderr[-3000:]
    module = subprocess.run([str(py), "-m", "hp_tool", "search_config=gpt3/nope"], cwd=elsewhere,
                            capture_output=True, text=True, timeout=300)
    assert module.returncode == 2 and "gpt3/5b" in module.stderr  # lists the installed presets
