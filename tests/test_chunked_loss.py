"""The chunked linear cross-entropy equals the whole-logits loss, its value and both gradients (rel 1e-5), for
chunks that do and do not divide the tokens, with ignored labels, and never holds more than one chunk's
logits. Pure torch on the CPU."""

import pytest
import torch

from hp_tool.trial.loss import IGNORE_INDEX, chunked_linear_cross_entropy, full_linear_cross_entropy
from hp_tool.trial.trace.peak import TensorPeak


def case(tokens: int = 96, hidden: int = 24, vocab: int = 300, ignored: int = 7):
    generator = torch.Generator().manual_seed(3)
    h = torch.randn(2, tokens // 2, hidden, generator=generator, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) * 0.5
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=generator)
    labels.view(-1)[torch.randperm(tokens, generator=generator)[:ignored]] = IGNORE_INDEX
    return h, w, labels


@pytest.mark.e2e
@pytest.mark.parametrize("chunk", [1, 7, 32, 96, 1000])
def test_chunked_loss_and_gradients_equal_the_full_loss(chunk):
    h, w, labels = case()
    grads = []
    for loss_fn in (full_linear_cross_entropy, lambda a, b, c: chunked_linear_cross_entropy(a, b, c, chunk)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = loss_fn(hh, ww, labels)
        (3.0 * loss).backward()  # an upstream factor, as a loss scale or a micro-batch share gives
        grads.append((loss.detach(), hh.grad, ww.grad))
    (full, full_h, full_w), (chunked, chunked_h, chunked_w) = grads
    torch.testing.assert_close(chunked.double(), full.double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(chunked_h, full_h, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(chunked_w.double(), full_w, rtol=1e-5, atol=1e-12)


@pytest.mark.e2e
def test_ignored_tokens_count_nowhere():
    h, w, labels = case(ignored=0)
    masked = labels.clone()
    masked[0, :10] = IGNORE_INDEX
    hh = h.clone().requires_grad_()
    chunked_linear_cross_entropy(hh, w, masked, 16).backward()
    assert torch.all(hh.grad[0, :10] == 0) and torch.any(hh.grad[0, 10:] != 0)
    kept = full_linear_cross_entropy(h[:, :][masked != IGNORE_INDEX][None], w, masked[masked != IGNORE_INDEX][None])
    assert float(chunked_linear_cross_entropy(h, w, masked, 16)) == pytest.approx(float(kept), rel=1e-9)


@pytest.mark.e2e
def test_only_one_chunk_of_logits_is_ever_held():
    """Peak tensor memory: the whole-logits loss holds every token's fp32 logits (and their softmax), the
    chunked one a chunk's; with 512 tokens over a 4096-word vocabulary in chunks of 64, about 8x less."""
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(512, 32, generator=generator, requires_grad=True)
    w = torch.randn(4096, 32, generator=generator, requires_grad=True)
    labels = torch.randint(0, 4096, (512,), generator=generator)
    peaks = {}
    for name, fn in (("full", full_linear_cross_entropy),
                     ("chunked", lambda a, b, c: chunked_linear_cross_entropy(a, b, c, 64))):
        tracker = TensorPeak()
        tracker.track(h, w, labels)
        with tracker:
            tracker.restart_peak()
            fn(h, w, labels).backward()
        peaks[name] = tracker.peak_bytes()
        h.grad = w.grad = None
    logits = 512 * 4096 * 4
    assert peaks["full"] > 2 * logits
    assert peaks["chunked"] < peaks["full"] / 3


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(), dict(dp=2, zero_stage=0), dict(dp=2, zero_stage=3), dict(pp=2, zero_stage=0)])
def test_trials_with_the_chunked_loss_train_as_the_full_loss(tmp_path, layout):
    """The torch engine's chunked loss (8-token chunks of 128-token micro-batches) gives the single-process
    full loss's first three losses (rel 1e-5) alone, under DDP, FSDP2 and PP."""
    import dataclasses

    from hp_tool.trial.train import run_trial
    from trial_helpers import read_metrics, tiny_spec, torchrun, write_spec

    def losses(folder, loss, **kw):
        spec = tiny_spec("llama", max_steps=3, warmup_steps=0, **kw)
        spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, loss=loss, loss_chunk_tokens=8))
        folder.mkdir()
        world = spec.parallel.tp * spec.parallel.pp * spec.parallel.dp
        if world == 1:
            run_trial(write_spec(spec, folder), str(folder / "out"))
        else:
            proc = torchrun(write_spec(spec, folder), folder / "out", world)
            assert proc.returncode == 0, proc.stderr[-3000:]
        return [m["loss"] for m in read_metrics(folder / "out")]

    reference = losses(tmp_path / "full", "full")
    assert losses(tmp_path / "chunked", "chunked", **layout) == pytest.approx(reference, rel=1e-5)


@pytest.mark.e2e
def test_the_chunked_loss_applies_the_head_itself():
    """With loss chunked the last stage returns hidden states (no whole logits) and the loss applies its head."""
    import dataclasses

    from hp_tool.trial.dist import DistEnv
    from hp_tool.trial.engines.torch_engine import TorchEngine
    from trial_helpers import tiny_spec

    spec = tiny_spec("llama")
    spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, loss="chunked", loss_chunk_tokens=8))
    engine = TorchEngine.build(spec, DistEnv(), torch.device("cpu"))
    (inputs,), labels = engine.batches.micro_batches(0)[0]
    assert engine.stage.head_in_loss
    assert engine.stage(inputs).shape[-1] == spec.model.hidden_size
    assert engine.step(0) is not None


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(dp=2, zero_stage=3, act_ckpt=2), dict(pp=2, zero_stage=0)])
def test_activation_offload_changes_no_number(tmp_path, layout):
    """Saved activations kept in host memory (torch's save_on_cpu) give the same losses: with checkpointing
    over FSDP2, and under PP."""
    import dataclasses

    from trial_helpers import read_metrics, tiny_spec, torchrun, write_spec

    def losses(folder, offload):
        spec = tiny_spec("llama", max_steps=3, warmup_steps=0, **layout)
        spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, activation_offload=offload))
        folder.mkdir()
        proc = torchrun(write_spec(spec, folder), folder / "out", 2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [m["loss"] for m in read_metrics(folder / "out")]

    assert losses(tmp_path / "offloaded", True) == pytest.approx(losses(tmp_path / "kept", False), rel=1e-6)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("act_ckpt", [0, 2])
def test_sequence_parallel_trains_as_tensor_parallel(tmp_path, act_ckpt):
    """TP2 with sequence parallelism (norms on sequence shards) gives the single process's losses."""
    import dataclasses

    from hp_tool.trial.train import run_trial
    from trial_helpers import read_metrics, tiny_spec, torchrun, write_spec

    single = tiny_spec("llama", max_steps=3, warmup_steps=0)
    (tmp_path / "one").mkdir()
    run_trial(write_spec(single, tmp_path / "one"), str(tmp_path / "one" / "out"))
    spec = tiny_spec("llama", tp=2, max_steps=3, warmup_steps=0, act_ckpt=act_ckpt, zero_stage=0)
    spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, sequence_parallel=True))
    (tmp_path / "sp").mkdir()
    proc = torchrun(write_spec(spec, tmp_path / "sp"), tmp_path / "sp" / "out", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [m["loss"] for m in read_metrics(tmp_path / "sp" / "out")]
    assert got == pytest.approx([m["loss"] for m in read_metrics(tmp_path / "one" / "out")], rel=1e-4)
