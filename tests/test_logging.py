"""Run outputs: Weights & Biases (offline mode, read back from the run's own file)."""

import json
import time

import pytest

from megatron_rl.config import Config


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
    from megatron_rl.training.loop import start_log

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

    from megatron_rl.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = Config()
    cfg.logging.wandb_project = "p"
    with pytest.raises(ConfigError, match=r"logging.wandb_project needs Weights & Biases: pip install wandb"):
        cfg.validate()
