"""The stats logger with every sink, offline (`common.metrics`)."""

import json
import os
from pathlib import Path

from rlstream.common.config import load_config


def test_stats_logger_all_sinks_offline(tmp_path, capsys):
    from rlstream.common.metrics import StatsLogger

    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "stats_logger.wandb.mode=offline",
                             "stats_logger.tensorboard.enabled=true"])
    logger = StatsLogger(cfg, total_steps=2)
    logger.log(1, {"reward/mean": 0.5, "loss/total": 0.1, "bad": float("nan")})
    logger.log(2, {"reward/mean": 0.75, "loss/total": 0.05})
    logger.close()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("step 1/2") and "reward 0.500" in out[0] and len(out) == 2
    run = Path(cfg.run_dir)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and "bad" not in recs[0]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    silent = StatsLogger(cfg, enabled=False)
    silent.log(3, {"x": 1.0})
    silent.close()


def test_wandb_group_tags_notes_reach_the_run(tmp_path):
    """stats_logger.wandb.{group, job_type, tags, notes} are passed to wandb.init and land on the (offline) run."""
    from rlstream.common.metrics import StatsLogger, wandb_init_args

    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "stats_logger.wandb.mode=offline",
                             "stats_logger.wandb.group=sweep-7", "stats_logger.wandb.job_type=train",
                             "stats_logger.wandb.tags=[grpo,tiny]", "stats_logger.wandb.notes=a note"])
    args = wandb_init_args(cfg, Path(cfg.run_dir))
    assert (args["group"], args["job_type"], args["tags"], args["notes"]) == ("sweep-7", "train", ["grpo", "tiny"],
                                                                               "a note")
    logger = StatsLogger(cfg, total_steps=1)
    run = logger._wandb
    assert (run.group, run.job_type, list(run.tags), run.notes) == ("sweep-7", "train", ["grpo", "tiny"], "a note")
    logger.close()
    default = wandb_init_args(load_config(None, [f"cluster.fileroot={tmp_path}"]), Path(tmp_path))
    assert default["group"] is None and default["tags"] is None and default["notes"] is None


def test_wandb_id_suffix_resumes_one_run_and_extra_config_and_server_reach_it(tmp_path, monkeypatch):
    """stats_logger.wandb.id_suffix gives a fixed run id (a restart resumes it), config adds entries next to the
    run's own, base_url points wandb at a self-hosted server; AReaL's wandb_api_key/wandb_base_url import to them."""
    from rlstream.common.areal import translate_areal
    from rlstream.common.metrics import StatsLogger, wandb_init_args

    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "stats_logger.wandb.mode=offline",
                             "stats_logger.wandb.id_suffix=train", "stats_logger.wandb.config={lab: rl, seed: -1}",
                             "stats_logger.wandb.base_url=http://127.0.0.1:9"])
    args = wandb_init_args(cfg, Path(cfg.run_dir))
    assert args["id"] == f"{cfg.experiment_name}_{cfg.trial_name}_train" and args["resume"] == "allow"
    assert args["config"]["lab"] == "rl" and args["config"]["seed"] == cfg.seed  # the run's own keys win
    logger = StatsLogger(cfg, total_steps=1)
    assert logger._wandb.id == args["id"] and logger._wandb.config["lab"] == "rl"
    assert os.environ["WANDB_BASE_URL"] == "http://127.0.0.1:9"
    logger.close()
    assert "id" not in wandb_init_args(load_config(None, [f"cluster.fileroot={tmp_path}"]), Path(tmp_path))
    t = translate_areal({"gconfig": {}, "stats_logger": {"wandb": {"wandb_api_key": "k", "wandb_base_url": "http://w",
                                                                    "id_suffix": "train", "config": None}}})
    assert t.config["stats_logger"]["wandb"] == {"api_key": "k", "base_url": "http://w", "id_suffix": "train",
                                                 "config": None}


def test_swanlab_offline_writes_the_logged_steps_to_its_logdir(tmp_path):
    """stats_logger.swanlab.mode=offline (no network): the steps' metrics and an evaluation are in the run's SwanLab
    backup under logdir, read back with swanlab's own reader; the config's API key is masked there."""
    import pytest

    pytest.importorskip("swanlab")
    from swanlab.data.porter.datastore import DataStore

    from rlstream.common.metrics import StatsLogger

    logdir = tmp_path / "sw"
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "stats_logger.tensorboard.enabled=false",
                             "stats_logger.swanlab.mode=offline", f"stats_logger.swanlab.logdir={logdir}",
                             "stats_logger.swanlab.project=proj", "stats_logger.swanlab.name=exp",
                             "stats_logger.swanlab.api_key=sk-secret", "stats_logger.swanlab.config={lab: rl}"])
    logger = StatsLogger(cfg, total_steps=3)
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": step / 4, "loss/total": 1.0 / step})
    logger.log_eval(2, {"eval/accuracy": 0.5})
    logger.close()
    (backup,) = logdir.glob("run-*/backup.swanlab")
    store = DataStore()
    store.open_for_scan(str(backup))
    records = [json.loads(r) for r in store]
    scalars = {(r["data"]["key"], r["data"]["step"]): r["data"]["metric"]["data"]
               for r in records if r["model_type"] == "Scalar" and not r["data"]["key"].startswith("__swanlab__")}
    assert {k: v for k, v in scalars.items() if k[0] == "reward/mean"} == {
        ("reward/mean", 1): 0.25, ("reward/mean", 2): 0.5, ("reward/mean", 3): 0.75}
    assert scalars["loss/total", 3] == 1 / 3 and scalars["eval/accuracy", 2] == 0.5
    (project,) = [r["data"]["name"] for r in records if r["model_type"] == "Project"]
    (experiment,) = [r["data"]["name"] for r in records if r["model_type"] == "Experiment"]
    assert (project, experiment) == ("proj", "exp")
    config = next(logdir.glob("run-*/files/config.yaml")).read_text()
    assert "lab" in config and "sk-secret" not in config
