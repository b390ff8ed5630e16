"""README.md and docs/*.md as a user reads them: every hp_tool command in them runs (as a dry run), every relative
link and #anchor resolves, the README stays short, and configuration.md lists every key of the schema."""

import re
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from hp_tool import config
from search_helpers import main_here

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:python3|hp-tool|sbatch)\s")


def code_and_prose(text: str) -> tuple[list[str], list[str]]:
    """(code lines: fenced or indented by 4 spaces after a blank line, prose lines)."""
    code, prose, fenced, in_block, previous_blank = [], [], False, False, True
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            code.append(line)
            continue
        indented = line.startswith("    ") and line.strip() and not line.lstrip().startswith(("-", "*", "|"))
        if indented and (in_block or previous_blank):
            code.append(line.strip())
            in_block = True
        else:
            in_block = in_block and not line.strip() == "" and line.startswith("    ")
            prose.append(line)
        previous_blank = not line.strip()
    return code, prose


def shell_commands(text: str) -> list[str]:
    """Code lines joined over trailing backslashes, comments dropped."""
    code, _ = code_and_prose(text)
    out, pending = [], ""
    for line in code:
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
        if line:
            out.append(line)
    return out


def is_hp_tool(words: list[str]) -> bool:
    return bool(words) and (words[0] == "hp-tool" or (len(words) > 1 and words[1].endswith("main.py"))
                            or words[:3] == ["python3", "-m", "hp_tool"]
                            or (words[0] == "sbatch" and len(words) > 1 and words[1].endswith("search.sbatch")))


def hp_tool_commands() -> list[tuple[str, str]]:
    """(page, command) for every command in README.md and docs/*.md that runs the hp_tool search."""
    found = []
    for page in PAGES:
        for command in shell_commands(page.read_text()):
            if not COMMAND.match(command):
                continue
            words = shlex.split(command)
            while words and ENV.match(words[0]):
                words = words[1:]
            if is_hp_tool(words):
                found.append((page.name, command))
    return found


def dry_run_argv(command: str, results: Path) -> tuple[list[str], dict]:
    """The command as a dry run writing under ``results``: (argv, extra environment)."""
    words = shlex.split(command)
    env = {}
    while ENV.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] == "sbatch":  # search.sbatch runs `python3 -m hp_tool <its arguments>`
        args = words[2:]
    elif words[0] == "hp-tool" or words[:3] == ["python3", "-m", "hp_tool"]:
        args = words[1:] if words[0] == "hp-tool" else words[3:]
    else:
        args = words[2:]
    args = [a for a in args if not a.startswith(("base_results_dir=", "dry_run="))]
    if "--cfg" not in args:
        args.append("dry_run=true")
    return [sys.executable, str(REPO / "main.py"), *args, f"base_results_dir={results}"], env


def test_docs_have_hp_tool_commands():
    pages = {page for page, _ in hp_tool_commands()}
    assert {"README.md", "configuration.md", "fine-tuning.md", "slurm.md", "how-it-works.md", "results.md"} <= pages


@pytest.mark.e2e
@pytest.mark.parametrize("command", sorted({c for _, c in hp_tool_commands()}))
def test_every_documented_command_runs_as_a_dry_run(tmp_path, command):
    """Each command as a dry run, in this process (search_helpers.main_here: the CLI's own entry)."""
    argv, env = dry_run_argv(command, tmp_path / "r")
    try:
        proc = main_here(*argv[2:], cwd=REPO, env=env)  # argv[:2]: the interpreter and main.py
    except Exception:  # what the process would have died of, as its exit 1 and traceback
        proc = subprocess.CompletedProcess(argv, 1, "", traceback.format_exc())
    assert proc.returncode == 0, f"{command}\n  exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-600:]}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    _, prose = code_and_prose(page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    _, prose = code_and_prose(page.read_text())
    text = re.sub(r"`[^`\n]*`", "", "\n".join(prose))
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md") if not t.startswith("#")}
    missing = [p.name for p in PAGES[1:] if p not in linked]
    assert not missing, f"README.md links none of {missing}"


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert 120 <= lines <= 160, f"README.md has {lines} lines; keep it between 120 and 160 and move detail to docs/"


def test_readme_setup_and_test_are_one_command_each():
    commands = shell_commands((REPO / "README.md").read_text())
    setup = [c for c in commands if c.startswith("pip install")]
    assert len(setup) == 1 and "&&" not in setup[0] and "ds_ops" not in setup[0], setup
    assert "python3 -m pytest" in commands


def test_configuration_page_lists_every_key_and_moved_key():
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import gen_configuration
    finally:
        sys.path.remove(str(REPO / "docs"))
    page = (REPO / "docs" / "configuration.md").read_text()
    assert gen_configuration.updated(page) == page, "docs/configuration.md is out of date: " \
                                                    "run python3 docs/gen_configuration.py"
    keys = gen_configuration.all_keys()
    assert {"dry_run", "cluster.slurm.partition", "gpu.peak_tflops.bf16", "search_config.train_settings.lora.rank",
            "search_config.inference_settings.max_batch_sizes"} <= set(keys)
    missing = [k for k in keys + list(config.MOVED_KEYS) + list(config.MOVED_KEYS.values()) if f"`{k}`" not in page]
    assert not missing, missing
