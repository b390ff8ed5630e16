"""One inference job: serve the chosen model on one TP x PP layout and measure batch latency.

    torchrun --nproc-per-node TP*PP -m hp_tool.trial.inference_worker CONFIG.yaml
    hp_tool.inference.search.inference_job(config_path)   # from a submitit job (ranks from its environment)

The model is the trial engine's: each rank builds its pipeline stage on meta, shards it with the
engine's tensor-parallel plan (DTensor via ``parallelize_module``), materialises only its shard and fills
it with the layout-independent random weights, so every layout serves the same model. A prompt of
``input_seq_len`` tokens (from the seed) is extended by exactly ``output_seq_len`` greedy tokens with a KV
cache; ``end_id`` does not stop a timed run. With PP > 1 each stage passes its hidden states to the next
(point-to-point send/recv at every step) and the last stage returns the new token to the first.

Rank 0 writes ``<output_dir>/result.json`` atomically; a failure becomes status ``oom`` or ``failed``. A config
whose engine is vLLM is run by hp_tool/trial/vllm_runner.py instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hp_tool.contracts.inference import InferenceJobConfig, empty_result, latency_stats, load_job_config, write_result
from hp_tool.trial import dist as tdist
from hp_tool.contracts import result as res
from hp_tool.trial.measure import now_s, synchronize
from hp_tool.trial.causal import CausalLMStage, soft_capped
from hp_tool.trial.models import build_stage
from hp_tool.trial.parallel import apply_tensor_parallel
from hp_tool.trial.weights import materialize

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Server:
    """This rank's stage and its neighbours (global ranks at the same TP coordinate)."""

    cfg: InferenceJobConfig
    stage: CausalLMStage
    device: torch.device
    dtype: torch.dtype
    pp_rank: int = 0
    prev_rank: Optional[int] = None
    next_rank: Optional[int] = None
    first_rank: Optional[int] = None  # first stage's rank at this TP coordinate
    last_rank: Optional[int] = None

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.cfg.pp - 1


def serving_dtype(cfg: InferenceJobConfig, device: torch.device) -> torch.dtype:
    """16-bit weights on GPU (as configured); fp32 on CPU, where 16-bit matmuls are slow or missing."""
    return DTYPES[cfg.precision] if device.type == "cuda" else torch.float32


def build_server(cfg: InferenceJobConfig, env: tdist.DistEnv, device: torch.device) -> Server:
    """This rank's materialised, sharded, initialised stage; allocates only its own shard."""
    needed = cfg.tp * cfg.pp
    if env.world_size != needed:
        raise RuntimeError(f"{cfg.config_id} needs TP*PP={needed} processes, "
                           f"{env.world_size} were started (torchrun --nproc-per-node {needed})")
    pp_rank, tp_rank, ranks = 0, 0, None
    mesh = None
    if env.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (cfg.pp, cfg.tp), mesh_dim_names=("pp", "tp"))
        pp_rank, tp_rank = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
        ranks = mesh.mesh  # [pp, tp] global ranks
    stage = build_stage(cfg.model, cfg.pp, pp_rank)
    if cfg.tp > 1:
        apply_tensor_parallel(stage, mesh["tp"], vocab_parallel=False)  # greedy decoding needs whole logits
    materialize(stage, device, cfg.seed, cfg.model.init_method_std)
    dtype = serving_dtype(cfg, device)
    stage.to(dtype).eval()
    server = Server(cfg, stage, device, dtype, pp_rank)
    if cfg.pp > 1:
        stages = [int(r) for r in ranks[:, tp_rank]]  # global rank of each stage at this TP coordinate
        server.prev_rank = stages[pp_rank - 1] if pp_rank > 0 else None
        server.next_rank = stages[pp_rank + 1] if pp_rank < cfg.pp - 1 else None
        server.first_rank, server.last_rank = stages[0], stages[-1]
    return server


def make_prompt(cfg: InferenceJobConfig, device: torch.device) -> torch.Tensor:
    """``[batch, input_seq_len]`` token ids from the seed, each row starting with ``start_id``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.input_seq_len), generator=gen)
    ids[:, 0] = cfg.start_id
    return ids.to(device)


def cache_masks(stage: CausalLMStage, positions: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
    """Each layer's mask for queries at ``positions`` [length] over the cache's keys (positions 0 to the last
    query): None where the layer attends causally to the whole sequence (a prompt step is causal under SDPA's
    is_causal, a one-token step sees the whole cache), else its sliding window's ``[1, 1, q, k]`` mask."""
    keys = torch.arange(int(positions[-1]) + 1, device=positions.device)
    behind = positions[:, None] - keys[None, :]
    return {key: None if window is None or window >= keys.numel() else ((behind >= 0) & (behind < window))[None, None]
            for key, window in stage.windows.items()}


def _layers(srv: Server, h: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
    stage = srv.stage
    extra = {}
    if stage.rotary_emb is not None:
        extra["position_embeddings"] = stage.rotary_emb(h, pos)
    masks = cache_masks(stage, pos[0])
    for key, layer in stage.layers.items():
        h = layer(h, attention_mask=masks[key], position_ids=pos, past_key_values=cache, use_cache=True, **extra)
    return h


@torch.no_grad()
def forward_step(srv: Server, tokens: Optional[torch.Tensor], start: int, length: int,
                 cache) -> Optional[torch.Tensor]:
    """One step over ``length`` new positions from ``start``; the next token ``[batch]`` on the first
    and last stages (None in between)."""
    stage, b = srv.stage, srv.cfg.batch_size
    pos = torch.arange(start, start + length, device=srv.device).unsqueeze(0)
    if srv.is_first:
        h = stage.embed_tokens(tokens)
        if stage.embed_scale is not None:  # the family's forward hooks, as the training stage applies them
            h = h * torch.tensor(stage.embed_scale, dtype=h.dtype)
        if stage.embed_positions is not None:
            h = h + stage.embed_positions(None, 0, position_ids=pos)
    else:
        h = torch.empty(b, length, srv.cfg.model.hidden_size, dtype=srv.dtype, device=srv.device)
        dist.recv(h, src=srv.prev_rank)
    h = _layers(srv, h, pos, cache)
    token = None
    if srv.is_last:
        logits = soft_capped(stage.lm_head(stage.norm(h[:, -1])), stage.logit_softcap)
        token = logits.float().argmax(dim=-1)
    else:
        dist.send(h.contiguous(), dst=srv.next_rank)
    if srv.cfg.pp > 1:  # the first stage embeds the new token at the next step
        if srv.is_last:
            dist.send(token, dst=srv.first_rank)
        elif srv.is_first:
            token = torch.empty(b, dtype=torch.long, device=srv.device)
            dist.recv(token, src=srv.last_rank)
    return token


def generate(srv: Server, prompt: torch.Tensor) -> tuple[Optional[torch.Tensor], float, float]:
    """(new tokens ``[batch, output_seq_len]`` on the first stage, time to first token s, total s)."""
    from transformers import DynamicCache

    cfg = srv.cfg
    cache = DynamicCache(config=srv.stage.config)  # indexed by global layer, whatever the stage
    if dist.is_initialized():
        dist.barrier()  # every stage starts the timed generation together
    t0 = now_s()
    token = forward_step(srv, prompt if srv.is_first else None, 0, cfg.input_seq_len, cache)
    synchronize(srv.device)
    ttft = now_s() - t0
    out = [token]
    for i in range(1, cfg.output_seq_len):
        feed = token.unsqueeze(1) if srv.is_first else None
        token = forward_step(srv, feed, cfg.input_seq_len + i - 1, 1, cache)
        out.append(token)
    synchronize(srv.device)
    total = now_s() - t0
    tokens = torch.stack(out, dim=1) if srv.is_first else None
    return tokens, ttft, total


def benchmark(srv: Server) -> dict:
    """Warm-up, then ``repeats`` timed generations; latency percentiles and throughput (rank 0's)."""
    cfg = srv.cfg
    prompt = make_prompt(cfg, srv.device)
    for _ in range(cfg.warmup):
        generate(srv, prompt)
    latencies, ttfts, tokens = [], [], None
    for _ in range(cfg.repeats):
        tokens, ttft, total = generate(srv, prompt)
        latencies.append(total)
        ttfts.append(ttft)
    stats = latency_stats(latencies, ttfts, cfg.batch_size, cfg.output_seq_len, cfg.tp * cfg.pp)
    stats["generated_tokens"] = tokens[0].tolist() if tokens is not None else None
    return stats


def _fail(exc: Exception, cfg: InferenceJobConfig, result: dict, out: Path, env: tdist.DistEnv) -> dict:
    """Record the failure (rank 0 names the earliest of any rank); multi-process: leave at once."""
    root = res.record_failure(exc, out, env.rank, env.world_size, f"inference {cfg.config_id}")
    result.update(status=root["status"], reason=root["reason"], end_time=res.iso_utc(time.time()))
    res.write_and_leave(out, env.rank, env.world_size, lambda: write_result(out, result))
    return result


def share_cpu_threads(env: tdist.DistEnv, device: torch.device) -> None:
    """On CPU, give each local process its share of the cores unless OMP_NUM_THREADS says otherwise:
    processes that each use every core slow each other down and distort the latencies."""
    if device.type != "cpu" or env.world_size == 1 or "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _vllm(cfg: InferenceJobConfig, rank: int) -> dict:
    from hp_tool.trial.vllm_runner import run_vllm  # imported where a job runs it

    return run_vllm(cfg, rank)


OTHER_ENGINES = {"vllm": _vllm}  # the serving engines besides this decode loop: config's engine -> its job


def run_inference(config_path: str | os.PathLike) -> dict:
    """Run the job described by ``config_path``; returns result.json's content (rank 0's view)."""
    cfg = load_job_config(config_path)
    env = tdist.read_env()
    other = OTHER_ENGINES.get(cfg.engine)
    if other is not None:
        return other(cfg, env.rank)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = tdist.select_device(env)
    result = empty_result(cfg)
    result.update(world_size=env.world_size, device=device.type, versions=res.versions(),
                  start_time=res.iso_utc(time.time()))
    share_cpu_threads(env, device)
    try:
        tdist.init_distributed(env, device)
        srv = build_server(cfg, env, device)
        result.update(benchmark(srv), status="ok", end_time=res.iso_utc(time.time()))
        if env.rank == 0:
            write_result(out, result)
        tdist.shutdown()
        return result
    except Exception as exc:  # every failure must leave a status on disk
        return _fail(exc, cfg, result, out, env)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hp_tool.trial.inference_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="inference/candidate_configs/<config_id>.yaml")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{tdist.read_env().rank} %(levelname)s %(name)s: %(message)s")
    return 0 if run_inference(args.config)["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
