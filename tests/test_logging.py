"""Run outputs: Weights & Biases (offline mode, read back from the run's own file)."""

import json
import time

import pytest

from megatron_rl.config import Config, ConfigError
from megatron_rl.config.run import WANDB_ENVIRONMENT
from tests.helpers import run_train


def wandb_history(run_dir) -> list[dict]:
    """The history rows (step and values) recorded in a run directory's offline W&B run files."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_logs_every_step_and_a_resume_continues_the_run(one_process, tmp_path):
    pytest.importorskip("wandb")
    from megatron_rl.training.run import start_log

    cfg = Config()
    cfg.logging.wandb_project, cfg.logging.wandb_mode = "megatron-rl-test", "offline"
    cfg.logging.progress = cfg.logging.tensorboard = False
    log, _ = start_log(cfg, tmp_path, 0)
    log.log(1, {"train/loss": 1.5})
    log.log(2, {"train/loss": 1.25, "val/accuracy": 0.5})
    log.close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    log, _ = start_log(cfg, tmp_path, 2)  # resumed: the same W&B run
    log.log(3, {"train/loss": 1.0})
    log.close()
    assert (tmp_path / "wandb_id").read_text().strip() == run_id
    assert all(p.name == f"run-{run_id}.wandb" for p in tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.time() + 20  # wandb's service may still be writing the resumed run's file (seen once in CI)
    while len(wandb_history(tmp_path)) < 3 and time.time() < deadline:
        time.sleep(0.2)
    rows = [{k: v for k, v in r.items() if k in ("_step", "train/loss", "val/accuracy")} for r in wandb_history(tmp_path)]
    assert rows == [{"_step": 1, "train/loss": 1.5}, {"_step": 2, "train/loss": 1.25, "val/accuracy": 0.5},
                    {"_step": 3, "train/loss": 1.0}]


def test_wandb_without_the_package_is_one_sentence(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = Config()
    cfg.logging.wandb_project = "p"
    with pytest.raises(ConfigError, match=r"logging.wandb_project needs Weights & Biases: pip install wandb"):
        cfg.validate()


def without_wandb_login(monkeypatch, tmp_path):
    """No W&B credentials: no $WANDB_API_KEY, no ~/.netrc."""
    for var in ("WANDB_API_KEY", "NETRC", "WANDB_BASE_URL", *WANDB_ENVIRONMENT.values()):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_wandb_takes_its_own_environment_variables_where_the_config_is_empty(monkeypatch, tmp_path):
    """WANDB_MODE=offline as a W&B user sets it: the run logs offline into $WANDB_DIR (the lines on stderr
    say where each field came from); a config field set on the command line wins over its variable."""
    pytest.importorskip("wandb")
    without_wandb_login(monkeypatch, tmp_path)
    for var, value in {"WANDB_MODE": "offline", "WANDB_PROJECT": "p", "WANDB_DIR": str(tmp_path / "wb")}.items():
        monkeypatch.setenv(var, value)
    short = ["--recipe", "tiny_sft", "train.max_steps=2", "data.num_train=256", "data.num_val=64",
             "logging.progress=false", "logging.tensorboard=false"]
    proc = run_train([*short, f"logging.run_dir={tmp_path / 'run'}"])
    assert "logging.wandb_mode=offline (from $WANDB_MODE)" in proc.stderr
    assert "logging.wandb_project=p (from $WANDB_PROJECT)" in proc.stderr
    assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    proc = run_train([*short, f"logging.run_dir={tmp_path / 'online'}", "logging.wandb_mode=online"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: logging to Weights & Biases online needs a login")
    assert "wandb login" in proc.stderr and "WANDB_MODE=offline" in proc.stderr
    assert not (tmp_path / "online").exists()


def test_wandb_variables_fill_only_empty_fields(monkeypatch):
    cfg = Config()
    cfg.logging.wandb_entity = "team"
    env = {"WANDB_PROJECT": "p", "WANDB_ENTITY": "other", "WANDB_MODE": "dryrun", "WANDB_RUN_ID": "abc"}
    taken = cfg.logging.take_environment(env)
    g = cfg.logging
    assert (g.wandb_project, g.wandb_entity, g.wandb_mode, g.wandb_run_id) == ("p", "team", "offline", "abc")
    assert taken == ["logging.wandb_project=p (from $WANDB_PROJECT)", "logging.wandb_mode=offline (from $WANDB_MODE)",
                     "logging.wandb_run_id=abc (from $WANDB_RUN_ID)"]
    cfg.logging.wandb_mode = "sometimes"
    with pytest.raises(ConfigError, match=r"logging.wandb_mode='sometimes' is not one of online, offline, disabled; "
                                          r"fix \$WANDB_MODE"):
        cfg.validate()
