"""The winner trains as it is: a tiny fine-tuning search on a Hugging Face checkpoint the test saves, then
`python3 -m hp_tool.train <optimal config> model.checkpoint=... data.path=<jsonl>` loads the real weights and
tokenizer, trains on the file's text (a sentence the test taught the checkpoint: the losses show which tokens the
run read) with the chosen layout on 2 CPU processes, and saves a checkpoint transformers loads."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from search_helpers import main_here
from test_finetune_trials import make_checkpoint

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the cat dog sat on mat ran far near a big small red blue green tree house river boat sun moon "
         "star quick slow jumps over under lazy fox bird sings loud soft").split()


def make_tokenizer(folder: Path, texts: list[str]) -> None:
    """A word-level tokenizer trained on ``texts``, saved beside the checkpoint as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)


@pytest.fixture
def model_and_data(tmp_path):
    rng = random.Random(3)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(200)]
    make_checkpoint(tmp_path / "model")
    make_tokenizer(tmp_path / "model", texts)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return tmp_path / "model", data


SENTENCE = "the quick red fox jumps over a lazy dog"  # no word twice: each word tells the next


def teach(folder: Path, text: str, steps: int = 12) -> None:
    """Train the checkpoint in ``folder`` (transformers' model, AdamW at 1e-2, every offset of ``text`` repeated,
    each repeat ended by the end-of-sequence token as hp_tool.train packs texts) until it predicts ``text``: 12
    steps take its loss there from 6.5 to 0.07, and on random tokens to 10.2."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    stream = torch.tensor(ids * (2 + 65 // len(ids)))
    windows = torch.stack([stream[i:i + 65] for i in range(len(ids))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = F.cross_entropy(model(input_ids=windows[:, :-1]).logits.flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)


def run(*args, cwd, timeout=600):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.e2e
def test_search_then_train_the_winner_on_the_real_checkpoint(tmp_path, model_and_data):
    model, _ = model_and_data
    # the search through the CLI's entry in this process (its one trial still runs on the local backend's 2 CPU
    # processes); the analytic memory check: what is tested is the winner's config, not the pre-launch trace
    proc = main_here("search_config=finetune/tiny", f"search_config.model.hf_config={model}", "cluster=local",
                     f"base_results_dir={tmp_path / 'res'}", "search_config.train_settings.seq_lengths=[64]",
                     "search_config.train_settings.limit_search_runs=1", "search_config.train_settings.max_steps_per_run=4",
                     "search_config.train_settings.search_strategy=exhaustive", "memory_check=analytic", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    optimal = next((tmp_path / "res" / "finetune" / "tiny" / "final_results").glob("optimal_config_*.yaml"))

    # the user's text is one sentence the checkpoint has learnt: on it the run's loss is far below what any
    # model pays on random tokens (ln 512 = 6.24, in expectation; this checkpoint 10.2)
    teach(model, SENTENCE)
    data = tmp_path / "sentence.jsonl"
    data.write_text((json.dumps({"text": SENTENCE}) + "\n") * 600)
    assert "# Train: python3 -m hp_tool.train <this file> model.checkpoint=... data.path=... save_dir=..." in \
        optimal.read_text()
    proc = run("-m", "hp_tool.train", str(optimal), f"model.checkpoint={model}", f"data.path={data}",
               f"save_dir={tmp_path / 'tuned'}", f"output_dir={tmp_path / 'run'}", "max_steps=3", cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # one save message, the method's; the plan (tokens, passes, steps) before the first step's progress line
    said = proc.stdout + proc.stderr
    assert said.count("saved the") == 1 and "saved the model to" in said and "adapters" not in said
    assert 0 <= proc.stdout.index("passes over the data) in 3 steps") < proc.stdout.index("step 1/3  loss ")
    assert "step 3/3  loss " in proc.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "ok" and result["steps_run"] == 3

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tuned, info = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    before = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    moved = [(tuned.state_dict()[k] - v).abs().max().item() for k, v in before.items()]
    assert max(moved) > 0 and max(moved) < 1e-3  # a few AdamW steps at full fine-tuning's 2e-5 from the checkpoint
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tuned")
    ids = tokenizer("the cat sat on the mat", return_tensors="pt")["input_ids"]
    loss = tuned(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    # the run trained on data.path: every step's loss is the taught checkpoint's on the sentence (0.07)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and 0 < max(losses) < 0.5


@pytest.mark.e2e
@pytest.mark.parametrize("bad, key, words", [
    ("shape", "model.checkpoint", "in the checkpoint but"),
    ("data", "data.path", "no such file"),
    ("key", "lr", "is not a key of hp_tool.train"),
])
def test_bad_train_input_fails_before_anything_is_written(tmp_path, model_and_data, capsys, bad, key, words):
    """``hp_tool.train``'s entry in this process (its exit code, what it says on stderr): the refusal comes before
    any process would start."""
    model, data = model_and_data
    from hp_tool import train
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config
    from hp_tool.contracts.spec import dump_spec
    from hp_tool.planner import make_plan

    cfg, name = compose(["search_config=finetune/tiny", f"search_config.model.hf_config={model}"])
    config = dump_spec(make_plan(to_app_config(cfg), name, tmp_path / "res").base, tmp_path / "base.yaml")
    if bad == "shape":
        make_checkpoint(tmp_path / "other")
        cfg_path = tmp_path / "other" / "config.json"
        wide = json.loads(cfg_path.read_text())
        from transformers import AutoConfig, AutoModelForCausalLM

        AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**wide, "intermediate_size": 192})).save_pretrained(
            tmp_path / "other")
        model = tmp_path / "other"
    args = [str(config), f"model.checkpoint={model}", f"data.path={tmp_path / 'none.jsonl' if bad == 'data' else data}",
            f"output_dir={tmp_path / 'run'}"] + (["lr=1e-3"] if bad == "key" else [])
    capsys.readouterr()
    code = train.main(args)
    err = capsys.readouterr().err
    assert code == 2 and key in err and words in err and "Fix:" in err, err
    assert not (tmp_path / "run").exists()
