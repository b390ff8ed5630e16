"""One command that checks a GPU: the project's own CLI on a Llama-2 7B shape at one GPU, predicted against
measured, written to docs/validation/<gpu>.md.

    python3 benchmarks/gpu_check.py --gpu h200        # or h100_80gb: one GPU of 80 GB or more; target 7 minutes
    python3 benchmarks/gpu_check.py --rehearse        # the same on CPU: gpu=cpu, finetune/tiny (minutes)

Four runs of `python3 main.py ... cluster=local`, each in its own results folder under --work-dir:
LoRA and QLoRA in one search, each at two micro-batch sizes, exhaustive, a few steps per trial; the H100 recipe's
choices, fp8 linears and torch.compile each on and off, on full fine-tuning of a model one GPU trains whole
(Qwen3-0.6B; on CPU the tiny model, where fp8 is refused and the compiled trials run); the inference
search at two batch sizes for the same shape as a llama preset (llama/llama2_7b, llama/tiny), its predicted TTFT,
TPOT, latency and throughput beside what hp_tool's own decode loop measured; last, full fine-tuning (ZeRO 3, offload none and optimizer_and_params; the
planner prunes what does not fit and the table shows it), whose offloaded trial holds the most host RAM. The gpu
preset's host RAM and CPU threads are set to this machine's (/proc/meminfo, os.cpu_count()), so offloaded
layouts are planned, and CPU Adam priced, for the node they run on. The tables come from the searches' own CSVs
(final_results/all_trials_<N>nodes.csv, inference/final_summary/final_output.csv; columns in docs/results.md);
nothing they give is recomputed. The page is rewritten after each search, so a run cut short still leaves what
it measured. Exit 1 when a search wrote no table or a launched trial (or
inference config) measured no step; 0 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a fresh GPU machine runs the check from a checkout, hp_tool not pip-installed

from hp_tool.inference.report import SUMMARY_CSV, SUMMARY_DIR  # noqa: E402
from hp_tool.vocab import INVALID, NOT_LAUNCHED, OVER_LIMIT, PRUNED  # noqa: E402

TS, IS = "search_config.train_settings", "search_config.inference_settings"
NOT_RUN_BY_PLAN = (PRUNED, INVALID, OVER_LIMIT, *NOT_LAUNCHED)  # training statuses of a trial never launched
INFERENCE_NOT_RUN = ("invalid", "over_memory", "over_slo")  # the inference grid's verdicts (hp_tool/inference/grid.py)
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "hydra-core", "submitit")
GIB = 1024 ** 3


@dataclass(frozen=True)
class Scale:
    """What a check runs: the model preset and the sizes of its trials (times in minutes)."""

    search_config: str
    seq_length: int
    global_batch_tokens: int
    full_ckpt_layers: int  # full fine-tuning at one GPU: every layer checkpointed
    full_micro_batches: tuple[int, ...]
    adapter_micro_batches: tuple[int, int]  # LoRA and QLoRA, no checkpointing
    inference_config: str  # the same shape as a llama preset: the inference search refuses finetune configs
    inference_batches: tuple[int, int]
    max_steps: int
    max_minutes: float  # each trial's (and inference config's) time limit
    recipe_model: str  # model.hf_config of the fp8 / compile search: full fine-tuning on one GPU, no offload
    recipe_micro_batch: int
    adapter_extra: tuple[str, ...] = ()


# Llama-2 7B at 2048 tokens, 8 sequences a step: 3 full candidates at MBS 2 (without offload, pruned on an 80 GB
# GPU; the optimizer offloaded, bf16 weights on the GPU; the parameters too: each offloaded step is about 10-15 s
# with the optimizer on 16 host cores, so each such trial takes 1-3 minutes), 4
# adapter candidates, 2 inference configs: about 7 minutes on one H100 when each trial measures its steps in
# well under its 3-minute limit.
GPU_SCALE = Scale("finetune/llama2_7b", 2048, 16384, 32, (2,), (2, 8), "llama/llama2_7b", (1, 16), 6, 3.0,
                  "qwen3_0_6b", 4)
# The same searches on finetune/tiny (4 layers, hidden 64). QLoRA is refused in fp32, the tiny preset's
# precision; the CPU trains in fp32 whatever the plan's precision (docs/configuration.md).
CPU_SCALE = Scale("finetune/tiny", 128, 1024, 4, (2, 8), (2, 8), "llama/tiny", (1, 8), 6, 2.0, "tiny", 4,
                  adapter_extra=(f"{TS}.precision=bf16",))


@dataclass(frozen=True)
class Search:
    """One run of the CLI: its name (also its folder under the work dir) and its Hydra overrides."""

    name: str
    search_config: str
    overrides: tuple[str, ...]
    inference: bool = False

    def argv(self, python: str = "python3") -> list[str]:
        return [python, "main.py", *self.overrides]

    def table_path(self, work_dir: Path) -> Optional[Path]:
        """The CSV this search's table is read from, None until it exists: under the search's own folder, where the
        CLI names the results folder (``finetune/custom`` after its model: ``finetune/tiny_custom``)."""
        pattern = f"**/{SUMMARY_DIR.as_posix()}/{SUMMARY_CSV}" if self.inference else \
            "**/final_results/all_trials_*nodes.csv"
        found = sorted((work_dir / self.name).glob(pattern))
        return found[0] if found else None


@dataclass(frozen=True)
class Host:
    """The node the check runs on, as the gpu preset's host keys take it."""

    ram_gib: float
    cpu_threads: int

    def overrides(self) -> list[str]:
        return [f"gpu.host_ram_gib={self.ram_gib:.1f}", f"gpu.host_cpu_cores={self.cpu_threads}"]


def this_host() -> Host:
    """This machine's RAM (MemTotal) and CPU threads."""
    kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal:"))
    return Host(kib / 1024 ** 2, os.cpu_count() or 1)


RECIPE_CONFIG = "finetune/custom"  # the fp8 / compile search's preset, its model given by model.hf_config
SEARCH_NAMES = ("adapters", "recipe", "inference", "full")  # the default order: the offloaded full trial last


def scale_for(gpu: str) -> Scale:
    return CPU_SCALE if gpu == "cpu" else GPU_SCALE


def hydra_list(values) -> str:
    return "[" + ",".join(str(v) for v in values) + "]"


def shown_path(path: Path) -> str:
    """A path as the commands show it: relative to the repository (where they run) when inside it."""
    path = Path(path)
    return str(path.relative_to(REPO)) if path.is_absolute() and path.is_relative_to(REPO) else str(path)


def searches(gpu: str, work_dir: Path, minutes_per_trial: Optional[float] = None,
             host: Optional[Host] = None) -> list[Search]:
    """The four CLI runs of a check on ``gpu`` (a gpu preset name; cpu: the rehearsal), each trial and
    inference config limited to ``minutes_per_trial`` (default: the scale's), on ``host`` (default: the
    preset's host RAM and CPU threads)."""
    s = scale_for(gpu)
    if minutes_per_trial is not None:
        s = dataclasses.replace(s, max_minutes=minutes_per_trial)

    def base(name: str, search_config: str) -> list[str]:
        return [f"search_config={search_config}", f"gpu={gpu}", "cluster=local",
                f"base_results_dir={shown_path(work_dir / name)}", f"{TS}.num_nodes=1", f"{TS}.gpus_per_node=1",
                f"{TS}.max_minutes_per_run={s.max_minutes:g}", *(host.overrides() if host else ())]

    train = [f"{TS}.seq_lengths=[{s.seq_length}]", f"{TS}.global_batch_tokens={s.global_batch_tokens}",
             f"{TS}.engines=[torch]", f"{TS}.tensor_parallel_sizes=[1]", f"{TS}.pipeline_parallel_sizes=[1]",
             f"{TS}.search_strategy=exhaustive", f"{TS}.max_steps_per_run={s.max_steps}"]
    full = base("full", s.search_config) + train + [
        f"{TS}.methods=[full]", f"{TS}.zero_stages=[3]", f"{TS}.offload=[none,optimizer,optimizer_and_params]",
        f"{TS}.micro_batch_sizes={hydra_list(s.full_micro_batches)}",
        f"{TS}.act_ckpt_layers=[{s.full_ckpt_layers}]", f"{TS}.act_ckpt_modes=[full]"]
    adapters = base("adapters", s.search_config) + train + [
        f"{TS}.methods=[lora,qlora]", f"{TS}.micro_batch_sizes={hydra_list(s.adapter_micro_batches)}",
        f"{TS}.act_ckpt_layers=[0]", *s.adapter_extra]
    recipe = base("recipe", RECIPE_CONFIG) + train + [
        f"search_config.model.hf_config={s.recipe_model}", f"{TS}.methods=[full]", f"{TS}.zero_stages=[3]",
        f"{TS}.offload=[none]", f"{TS}.micro_batch_sizes=[{s.recipe_micro_batch}]", f"{TS}.act_ckpt_layers=[0]",
        f"{TS}.fp8=[false,true]", f"{TS}.compile=[false,true]"]
    inference = base("inference", s.inference_config) + [
        "run_training_hp_search=false", "run_inference_hp_search=true", f"{IS}.tensor_parallel_sizes=[1]",
        f"{IS}.pipeline_parallel_sizes=[1]", f"{IS}.max_batch_sizes={hydra_list(s.inference_batches)}"]
    return [Search("adapters", s.search_config, tuple(adapters)), Search("recipe", RECIPE_CONFIG, tuple(recipe)),
            Search("inference", s.inference_config, tuple(inference), inference=True),
            Search("full", s.search_config, tuple(full))]


# ---- the tables: (header, CSV column, format) rows; the page only formats what the CSVs hold ----

TRAINING_COLUMNS = (
    ("method", "method", "text"), ("ZeRO", "zero_stage", "text"), ("offload", "offload", "text"),
    ("MBS", "mbs", "text"), ("ckpt", "act_ckpt_layers", "text"), ("fp8", "fp8", "text"),
    ("compiled", "compile", "text"), ("status", "status", "text"),
    ("step s pred", "predicted_step_time_s", "sig"), ("step s meas", "measured_step_time_s", "sig"),
    ("step err %", "step_time_error_pct", "pct"),
    ("GiB analytic", "predicted_memory_gib", "gib"), ("GiB traced", "traced_memory_gib", "gib"),
    ("GiB meas", "peak_memory_gib", "gib"),
    ("tensor GiB analytic", "predicted_tensor_memory_gib", "gib"),
    ("tensor GiB traced", "traced_tensor_memory_gib", "gib"), ("tensor GiB meas", "peak_tensor_memory_gib", "gib"),
    ("MFU", "mfu", "frac"), ("tok/s/GPU pred", "predicted_tokens_per_s_per_gpu", "int"),
    ("tok/s/GPU meas", "tokens_per_s_per_gpu", "int"), ("reason", "reason", "reason"),
)
INFERENCE_COLUMNS = (
    ("batch", "batch_size", "text"), ("TP", "tp", "text"), ("status", "status", "text"),
    ("GiB pred", "predicted_memory_gib", "gib"), ("latency p50 ms", "latency_ms_p50", "sig"),
    ("latency p99 ms", "latency_ms_p99", "sig"), ("TTFT ms", "time_to_first_token_ms", "sig"),
    ("tok/s", "tokens_per_s", "int"), ("tok/s/GPU", "tokens_per_s_per_gpu", "int"), ("reason", "reason", "reason"),
)
REASON_CHARS = 300


def cell(value: Optional[str], kind: str) -> str:
    """One CSV cell as the page shows it; an empty cell (not measured, not applicable) is '-'."""
    if value is None or value == "":
        return "-"
    if kind == "text":
        return value
    if kind == "reason":
        text = " ".join(value.split()).replace("|", "\\|")
        return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."
    number = float(value)
    return {"sig": f"{number:.4g}", "pct": f"{number:+.1f}", "gib": f"{number:.2f}", "frac": f"{number:.3f}",
            "int": f"{number:,.0f}"}[kind]


def extra_predictions(rows: list[dict]) -> tuple[tuple[str, str, str], ...]:
    """Columns ``predicted_*`` of an inference CSV besides memory (the serving-time model's TTFT, TPOT, batch
    latency, tokens/s per GPU and dollars per million tokens), each shown beside what was measured."""
    names = sorted({k for r in rows for k in r if k.startswith("predicted_") and k != "predicted_memory_gib"})
    return tuple((name.removeprefix("predicted_") + " pred", name, "sig") for name in names)


def markdown_table(rows: list[dict], columns) -> str:
    """Rows (CSV dicts) as a markdown table of ``columns`` ((header, CSV column, format), ...)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c), kind) for _, c, kind in columns) + " |" for r in rows]
    return "\n".join(lines)


def inference_columns(rows: list[dict]):
    return INFERENCE_COLUMNS[:-1] + extra_predictions(rows) + INFERENCE_COLUMNS[-1:]


@dataclass
class Tally:
    """Launched trials (or inference configs) and how many of them measured at least one step."""

    launched: int = 0
    measured: int = 0
    failed: list[str] = field(default_factory=list)  # what did not measure, one line each


def tally(training: list[dict], inference: list[dict]) -> Tally:
    """Counts over the CSV rows: a training trial measured when it has a measured step time, an inference
    config when it has a median latency; the plan's verdicts were never launched."""
    out = Tally()
    for rows, not_run, measure, what in ((training, NOT_RUN_BY_PLAN, "measured_step_time_s", "trial_id"),
                                         (inference, INFERENCE_NOT_RUN, "latency_ms_p50", "config_id")):
        for r in rows:
            if r.get("status") in not_run:
                continue
            out.launched += 1
            if r.get(measure):
                out.measured += 1
            else:
                out.failed.append(f"{r.get(what)}: {r.get('status')} ({cell(r.get('reason'), 'reason')})")
    return out


@dataclass
class SearchRun:
    """What one CLI run left: its argv, exit code, seconds, and its table's rows (None: no table)."""

    search: Search
    code: Optional[int] = None  # None: not run yet
    seconds: float = 0.0
    rows: Optional[list[dict]] = None
    error: str = ""  # the output's tail when it wrote no table


@dataclass
class Page:
    gpu: str
    command: str
    date: str
    versions: dict
    runs: list[SearchRun]
    seconds: float


def passed(runs: list[SearchRun]) -> bool:
    """Every search wrote its table, something launched, and every launched trial measured a step."""
    if any(r.rows is None for r in runs):
        return False
    t = tally(*rows_by_kind(runs))
    return t.launched > 0 and t.measured == t.launched


def rows_by_kind(runs: list[SearchRun]) -> tuple[list[dict], list[dict]]:
    training = [row for r in runs if not r.search.inference for row in (r.rows or [])]
    inference = [row for r in runs if r.search.inference for row in (r.rows or [])]
    return training, inference


TRAINING_NOTE = ("One row per candidate of the LoRA/QLoRA, recipe (fp8, compile) and full searches, from their "
                 "`all_trials_*.csv`: `step err %` is its `step_time_error_pct`; `GiB analytic` and `GiB traced` "
                 "include the gpu preset's `memory_overhead_gib`, `GiB meas` is the device's peak allocation (on CPU "
                 "the process RSS); the tensor columns count live tensors only, on both sides.")
INFERENCE_NOTE = ("From `inference/final_summary/final_output.csv`: measured beside the serving-time model's "
                  "predictions (`... pred`: TTFT, TPOT, batch latency, tokens/s per GPU; hp_tool/estimate/serving.py, "
                  "fitted on published serving runs, not on this GPU), on hp_tool's own decode loop.")


def section(title: str, note: str, rows: list[dict], columns) -> list[str]:
    """A titled table; columns the CSV lacks are named (a renamed column must not pass as '-')."""
    if not rows:
        return [f"## {title}", "", "(no table)", ""]
    missing = [c for _, c, _ in columns if c not in rows[0]]
    lacks = [f"Not in the CSV, shown as -: {', '.join(missing)}.", ""] if missing else []
    return [f"## {title}", "", note, "", *lacks, markdown_table(rows, columns), ""]


def render_tables(runs: list[SearchRun]) -> str:
    """The training and inference tables (what the terminal prints too)."""
    training, inference = rows_by_kind(runs)
    return "\n".join(section("Training: predicted against measured", TRAINING_NOTE, training, TRAINING_COLUMNS)
                     + section("Inference: predicted against measured", INFERENCE_NOTE, inference,
                               inference_columns(inference))).rstrip()


def render_page(page: Page) -> str:
    """docs/validation/<gpu>.md: verdict, tables, versions, the command and each CLI run."""
    t = tally(*rows_by_kind(page.runs))
    verdict = "PASS" if passed(page.runs) else "FAIL"
    lines = [f"# GPU check: {page.gpu}", "",
             f"{verdict}: {t.measured} of {t.launched} launched trials and inference configs measured a step; "
             f"{page.date}, {page.seconds / 60:.1f} minutes.", "",
             "    " + page.command, ""]
    if t.failed:
        lines += ["Measured nothing:", ""] + [f"- {f}" for f in t.failed] + [""]
    lines += [render_tables(page.runs), "", "## Versions", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in page.versions.items()]
    lines += ["", "## The CLI runs", ""]
    for r in page.runs:
        state = "not run" if r.code is None else f"exit {r.code}, {r.seconds:.0f} s"
        lines += [f"`{r.search.name}` ({state}):", "", "    " + shlex.join(r.search.argv()), ""]
        if r.error:
            lines += ["No table; the output ended with:", "", "```", r.error.rstrip(), "```", ""]
    return "\n".join(lines)


# ---- I/O: running the CLI, reading its CSVs, versions ----

def read_rows(path: Optional[Path]) -> Optional[list[dict]]:
    if path is None:
        return None
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def run_search(search: Search, work_dir: Path) -> SearchRun:
    """Run one CLI search from a fresh folder, its output streamed to the terminal and to <folder>.log."""
    folder = work_dir / search.name
    shutil.rmtree(folder, ignore_errors=True)  # a check measures afresh; the folder would resume otherwise
    folder.mkdir(parents=True)
    argv = search.argv(sys.executable)
    print(f"\n=== {search.name}: {shlex.join(search.argv())}", flush=True)
    start, tail = time.monotonic(), collections.deque(maxlen=30)
    with (work_dir / f"{search.name}.log").open("w") as log, \
            subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            tail.append(line)
    run = SearchRun(search, proc.returncode, time.monotonic() - start)
    run.rows = read_rows(search.table_path(work_dir))
    if run.rows is None:
        run.error = "".join(tail)
    return run


def versions() -> dict:
    """Python, the packages a trial uses, CUDA and the device, and the repository's commit."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    import torch  # the check's own process; trials import it anyway

    out["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info(0)
        out["device"] = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
        out["device memory"] = f"{total / GIB:.2f} GiB (torch.cuda.mem_get_info total)"
    else:
        out["device"] = f"CPU, {os.cpu_count()} cores (no CUDA device)"
    out["hp_tool commit"] = commit()
    return out


def commit() -> str:
    """The checkout's commit, marked when the tree has local changes; a copy without git says so."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)  # noqa: E731
    if shutil.which("git") is None or (head := git("rev-parse", "--short", "HEAD")).returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" (with local changes)" if git("status", "--porcelain").stdout.strip() else "")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", help="the gpu preset of this machine's GPU (h200, h100_80gb, ...); cpu: rehearse")
    p.add_argument("--rehearse", action="store_true", help="the same check on CPU: gpu=cpu, finetune/tiny")
    p.add_argument("--work-dir", type=Path, help="results folders (default results/gpu_check/<gpu>)")
    p.add_argument("--out", type=Path, help="the page to write (default docs/validation/<gpu>.md)")
    p.add_argument("--searches", default=",".join(SEARCH_NAMES),
                   help=f"which of the four searches to run, in the order given (default: {','.join(SEARCH_NAMES)})")
    p.add_argument("--minutes-per-trial", type=float,
                   help="each trial's and inference config's time limit (default 3 on a GPU, 2 on CPU)")
    args = p.parse_args(argv)
    args.searches = [name.strip() for name in args.searches.split(",") if name.strip()]
    if not args.searches or set(args.searches) - set(SEARCH_NAMES):
        p.error(f"--searches {','.join(args.searches)}: name some of {', '.join(SEARCH_NAMES)}")
    if args.rehearse:
        args.gpu = "cpu"
    if not args.gpu:
        p.error("give --gpu <preset> (e.g. h200, h100_80gb) or --rehearse")
    args.work_dir = (args.work_dir or REPO / "results" / "gpu_check" / args.gpu).resolve()
    args.out = args.out or REPO / "docs" / "validation" / f"{args.gpu}.md"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python3", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    args.work_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    host = this_host()
    by_name = {s.name: s for s in searches(args.gpu, args.work_dir, args.minutes_per_trial, host)}
    page = Page(args.gpu, command, datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                {**versions(), "host (as gpu.host_ram_gib, gpu.host_cpu_cores)":
                 f"{host.ram_gib:.1f} GiB RAM, {host.cpu_threads} CPU threads"},
                [SearchRun(by_name[name]) for name in args.searches], 0.0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render_page(page) + "\n")  # rewritten after each search: a cut-short run keeps its part
    for i, pending in enumerate(page.runs):
        page.runs[i] = run_search(pending.search, args.work_dir)
        page.seconds = time.monotonic() - start
        args.out.write_text(render_page(page) + "\n")
    t = tally(*rows_by_kind(page.runs))
    print("\n" + render_tables(page.runs) + "\n")
    print(f"{'PASS' if passed(page.runs) else 'FAIL'}: {t.measured} of {t.launched} launched measured a step "
          f"in {page.seconds / 60:.1f} minutes; wrote {args.out}")
    return 0 if passed(page.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
