"""Module-name literals of model families in the trial engine's shared code: the places outside the family
records (``hp_tool/trial/families/``) that name a family's modules (``self_attn``, ``q_proj``, ``lm_head``,
T5's ``SelfAttention`` ...), found with ``ast``: string constants that contain such a name as a word (not
docstrings, nor prose: a string with whitespace in it is a message, not a module's name), and attribute
names that are one.

    python benchmarks/family_literals.py [--list] [PATH]

PATH: the trial package (default ``hp_tool/trial``). Prints the count, and how many of them are the names
every stage module gives its own parts whatever the family (``STAGE_PARTS``: ``hp_tool/trial/stage.py``,
the canonical parameter names); with ``--list`` each site too.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIAL = ROOT / "hp_tool" / "trial"
FAMILY_DIR = "families"

# The module names of the families' transformers models (Llama and its derivatives, OPT, Mixtral and
# Qwen2-MoE, T5, and the fused or extra modules of Phi-3 and Gemma).
MODULE_NAMES = frozenset({
    "self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj",
    "down_proj", "gate_up_proj", "embed_tokens", "embed_positions", "lm_head", "rotary_emb",
    "block_sparse_moe", "experts", "shared_expert", "fc1", "fc2", "out_proj", "self_attn_layer_norm",
    "final_layer_norm", "SelfAttention", "EncDecAttention", "DenseReluDense", "relative_attention_bias",
    "wi_0", "wi_1", "wo",
})
# The parts every pipeline stage module holds under the same names for every family (the canonical,
# layout-independent parameter names of hp_tool/trial/stage.py): counted, and reported apart.
STAGE_PARTS = frozenset({"embed_tokens", "embed_positions", "lm_head", "rotary_emb"})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPACE = re.compile(r"\s")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants (and of other bare string statements) of ``tree``."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def file_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, literal)`` of each module-name literal in one Python file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if not _SPACE.search(node.value) and any(word in MODULE_NAMES for word in _WORD.findall(node.value)):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.Attribute) and node.attr in MODULE_NAMES:
            found.append((node.lineno, node.attr))
    return sorted(found)


def module_name_literals(path: str | Path = TRIAL) -> list[tuple[str, int, str]]:
    """``(file, line, literal)`` of every module-name literal in the Python files under ``path`` (the trial
    package), its ``families/`` folder left out; files relative to ``path``."""
    root = Path(path)
    out = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root)
        if rel.parts[0] == FAMILY_DIR:
            continue
        out.extend((str(rel), line, literal) for line, literal in file_literals(file))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(TRIAL))
    parser.add_argument("--list", action="store_true", help="print every site")
    args = parser.parse_args()
    sites = module_name_literals(args.path)
    if args.list:
        for file, line, literal in sites:
            print(f"{file}:{line}: {literal!r}")
    stage_parts = sum(1 for _, _, literal in sites if set(_WORD.findall(literal)) <= STAGE_PARTS)
    print(f"family module-name literals outside trial/families/: {len(sites)} "
          f"({stage_parts} of them the stage modules' own part names, {len(sites) - stage_parts} others)")


if __name__ == "__main__":
    main()
