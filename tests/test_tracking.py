"""W&B: start-up checks, offline runs per trial and for the summary, and the API key kept out of
everything written."""

import os
import sys
import time

import pytest
from test_results_helpers import planned, selected_ids, write_metrics, write_ok

from hp_tool.config import WandbConfig
from hp_tool.errors import ConfigError
from hp_tool.search import finalize
from hp_tool.contracts.spec import load_spec

KEY = "0123456789abcdef0123456789abcdef01234567"  # a made-up 40-character key


@pytest.fixture
def offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    folder = tmp_path / "wandb_dir"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(folder))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return folder


def key_file(tmp_path, text=KEY + "\nsecond line is ignored\n"):
    path = tmp_path / "wandb_key"
    path.write_text(text)
    return str(path)


def runs(folder):
    return sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))


def run_bytes(run, needle, timeout_s=20.0):
    """The run file once it holds ``needle``: wandb's service process may still be flushing it."""
    deadline = time.monotonic() + timeout_s
    while needle not in run.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    return run.read_bytes()


def test_disabled_needs_nothing(tmp_path, monkeypatch):
    """With W&B off, wandb need not be installed: the check passes, a search's summary is written, and
    no W&B folder appears."""
    from hp_tool.tracking import check_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    assert check_wandb(WandbConfig(enable=False)) is None
    with pytest.raises(ConfigError):  # the same missing package is refused once W&B is on
        check_wandb(WandbConfig(enable=True))
    app, out, plan = planned(tmp_path)
    write_ok(out, selected_ids(plan)[0], 0.2)
    assert finalize(out, app) == 0
    assert (out / "final_results").is_dir() and any((out / "final_results").iterdir())
    assert not (tmp_path / "wandb_dir").exists() and not list(tmp_path.rglob("wandb"))


def test_missing_wandb_names_the_key_and_the_install(monkeypatch):
    from hp_tool.tracking import check_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as err:
        check_wandb(WandbConfig(enable=True))
    assert err.value.key == "wandb.enable" and 'pip install -e ".[wandb]"' in str(err.value)


@pytest.mark.parametrize("content", [None, "", "\n  \n"])
def test_missing_or_empty_key_file(tmp_path, monkeypatch, content):
    pytest.importorskip("wandb")
    from hp_tool.tracking import check_wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    path = str(tmp_path / "absent") if content is None else key_file(tmp_path, content)
    with pytest.raises(ConfigError) as err:
        check_wandb(WandbConfig(enable=True, api_key_file=path))
    assert err.value.key == "wandb.api_key_file" and path in str(err.value)
    with pytest.raises(ConfigError, match="wandb.api_key_file=None"):
        check_wandb(WandbConfig(enable=True, api_key_file=None))


@pytest.mark.e2e
def test_offline_needs_no_key(tmp_path, offline):
    """Offline, no key file is needed: the check passes and a trial is still logged as an offline run."""
    from hp_tool import tracking

    cfg = WandbConfig(enable=True, api_key_file=None)
    assert tracking.check_wandb(cfg) is None
    _, out, plan = planned(tmp_path)
    tid = selected_ids(plan)[0]
    write_metrics(out, tid, [0.9, 0.3])
    result = write_ok(out, tid, 0.25)
    tracking.log_trial(load_spec(out / "candidate_configs" / f"{tid}.yaml"), out / "training_logs" / tid,
                       result, cfg)
    (run,) = runs(offline)
    assert tid.encode() in run_bytes(run, tid.encode())


def test_online_key_goes_to_wandb_settings_only(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from hp_tool import tracking

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop before any network")

    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.setattr(wandb, "login", lambda *a, **k: pytest.fail("wandb.login would save the key"))
    cfg = WandbConfig(enable=True, api_key_file=key_file(tmp_path), project="p")
    with pytest.raises(RuntimeError):
        tracking._init(cfg, tmp_path, name="x")
    assert seen["settings"].api_key == KEY and "WANDB_API_KEY" not in os.environ
    assert all(KEY not in repr(v) for k, v in seen.items() if k != "settings")


@pytest.mark.e2e
def test_log_trial_writes_an_offline_run(tmp_path, offline):
    from hp_tool import tracking

    _, out, plan = planned(tmp_path)
    tid = selected_ids(plan)[0]
    write_metrics(out, tid, [0.9, 0.3, 0.2])
    result = write_ok(out, tid, 0.25)
    spec = load_spec(out / "candidate_configs" / f"{tid}.yaml")
    cfg = WandbConfig(enable=True, api_key_file=key_file(tmp_path), project="hp_tool_test")
    tracking.log_trial(spec, out / "training_logs" / tid, result, cfg)
    (run,) = runs(offline)
    data = run_bytes(run, b"tokens_per_s_per_gpu")
    assert tid.encode() in data and b"step_time_s" in data and b"tokens_per_s_per_gpu" in data
    written = b"".join(p.read_bytes() for p in offline.rglob("*") if p.is_file())
    assert KEY.encode() not in written


@pytest.mark.e2e
def test_finalize_logs_the_summary_table(tmp_path, offline, capsys):
    app, out, plan = planned(tmp_path, "wandb.enable=true", f"wandb.api_key_file={key_file(tmp_path)}")
    for i, tid in enumerate(selected_ids(plan)[:2]):
        write_ok(out, tid, 0.1 * (i + 1))
    assert finalize(out, app) == 0
    (run,) = runs(offline)
    tables = list(run.parent.glob("files/media/table/all_trials_*.table.json"))
    assert len(tables) == 1 and selected_ids(plan)[0] in tables[0].read_text()
    logged = b"".join(p.read_bytes() for p in offline.rglob("*") if p.is_file())
    printed = capsys.readouterr()
    for place in (logged, (printed.out + printed.err).encode(),
                  *(p.read_bytes() for p in (out / "final_results").iterdir())):
        assert KEY.encode() not in place
