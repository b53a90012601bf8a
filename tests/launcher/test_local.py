"""`rlstream run` end to end, as a user runs it: real redis-server, engine, producer, trainer.

- a short run of the CPU demo config (past one epoch) finishes and leaves metrics, plots, the final
  checkpoint and the before/after accuracy behind, with no process of the run left;
- a run whose data runs out stops early (exit 1, the reason) and still leaves plots,
  summary and a final checkpoint of what it trained;
- SIGKILL of one child (an engine, a producer) stops the whole run with a message
  naming that child; nothing of the run survives and its ports are free again, and
  the trainer's steps are kept as `final`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from rlstream.broker import Keys, namespace

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny-cpu.yaml"

# Small and fast: a few steps on a small slice of the demo task.
SMALL = [
    "launcher.demo.n_train=256", "launcher.demo.n_valid=16", "launcher.eval_n=16", "launcher.sft_steps=20",
    "rollout.consumer_batch_size=4", "gconfig.n_samples=4", "stats_logger.log_every_secs=2",
    "stats_logger.tensorboard.enabled=false",
]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def _run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process started for the run at `run_dir` (they carry RLSTREAM_RUN_DIR)."""
    want = str(run_dir.resolve())
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get("RLSTREAM_RUN_DIR") == want and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _port_free(port: int) -> bool:
    """Nobody listens on the port: a server restarted on it can bind (SO_REUSEADDR, as servers do;
    connections of the stopped run may linger in TIME_WAIT, which is normal TCP)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _start(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "rlstream.launcher.cli", "run", "--config", str(CONFIG),
            f"cluster.fileroot={tmp_path / 'runs'}", *SMALL, *overrides]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _ports_of_run(run_dir: Path, with_redis: bool = True) -> list[int]:
    ports = []
    for f in (run_dir / "engines").glob("*.addr"):
        ports.append(int(f.read_text().strip().rsplit(":", 1)[1]))
    cfg = run_dir / "config.yaml"
    if with_redis and cfg.exists():
        for line in cfg.read_text().splitlines():
            if line.strip().startswith("url: redis://127.0.0.1:"):
                ports.append(int(line.split(":")[-1].split("/")[0]))
    return ports


@pytest.mark.slow
def test_run_end_to_end(tmp_path):
    # 16 prompts / batch 4 = 4 steps per epoch: 6 steps need the producer to feed a second epoch.
    proc = _start(tmp_path, "total_train_steps=6", "launcher.demo.n_train=16")
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        _stop(proc)
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    assert proc.returncode == 0, f"rlstream run failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all("reward/mean" in r for r in rows)
    assert "budget: 6 steps (total_train_steps; an epoch is 4 steps (16 prompts" in out
    inspect_line = next(ln for ln in out.splitlines() if ln.startswith("inspect: rlstream inspect --redis redis://"))
    assert inspect_line.endswith(" -n rlstream:tiny-cpu:run0")
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()
    assert list((run_dir / "checkpoints" / "final").glob("*.safetensors"))
    for name in ("reward", "staleness", "throughput", "time_split"):
        png = run_dir / "plots" / f"{name}.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["acc_before"] <= 1.0 and 0.0 <= summary["acc_after"] <= 1.0
    assert "held-out accuracy before RL" in out and "held-out accuracy after RL" in out
    # The first screen: each message once, no library deprecation noise.
    assert "deprecated" not in out + err
    assert (out + err).count("demo task") == 1 and (out + err).count("warm start done") == 1
    stale = json.loads((run_dir / "staleness.json").read_text())
    assert stale["n"] == 6 * 4  # every trained group, B = 4 per step
    assert summary["steps"] == summary["total_steps"] == 6 and summary["finished"] and summary["stop_reason"] is None
    assert max(int(k) for k in stale["histogram"]) <= 1  # within the budget eta = 1
    for name in ("redis", "engine-0", "producer-0", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
    assert _run_processes(run_dir) == []
    for port in _ports_of_run(run_dir):
        assert _port_free(port), f"port {port} still bound after the run"


@pytest.mark.slow
def test_lora_run_evaluates_during_training(tmp_path):
    """`actor.lora` + `evaluator.freq_steps`: every push carries the adapter's bytes only, the producer
    evaluates the served version on valid_dataset every >= 2 versions starting at the base model
    (eval/accuracy rows in metrics.jsonl), and `final` is the merged model with the adapter beside it."""
    from safetensors import safe_open

    proc = _start(tmp_path, "total_train_steps=8", "actor.lora.rank=4", "actor.lora.alpha=8",
                  "actor.optimizer.lr=1e-3", "evaluator.freq_steps=2", "evaluator.max_prompts=8")
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        _stop(proc)
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    assert proc.returncode == 0, f"rlstream run failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/total" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    versions = [int(r["eval/version"]) for r in evals]
    assert versions[0] == 0 and len(versions) >= 2, versions  # the base model, then at least one trained version
    assert all(b - a >= 2 for a, b in zip(versions, versions[1:])), versions
    assert all(r["step"] == int(r["eval/version"]) and 0 <= r["eval/accuracy"] <= 1 and r["eval/n_prompts"] == 8
               for r in evals)

    final = run_dir / "checkpoints" / "final"
    with safe_open(str(final / "adapter" / "adapter_model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
        adapter_bytes = sum(fh.get_tensor(k).numel() * fh.get_tensor(k).element_size() for k in names)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    with safe_open(str(final / "model.safetensors"), framework="pt") as fh:
        merged = list(fh.keys())
    assert merged and not any("lora" in k for k in merged)  # a plain HF folder
    assert all(r["perf/push_bytes"] == adapter_bytes for r in steps), (adapter_bytes, [r.get("perf/push_bytes") for r in steps])


@pytest.mark.slow
def test_run_that_runs_out_of_data_keeps_what_it_trained(tmp_path):
    """The producer stops after 6 groups (1 step of 4 + 2): the run stops early, exit 1, with the
    reason, and still leaves the plots, the summary and a final checkpoint of the step trained."""
    proc = _start(tmp_path, "total_train_steps=40", "producer.max_groups=6", "launcher.eval_n=0",
                  "launcher.data_out_timeout=8")
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        _stop(proc)
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    assert proc.returncode == 1, f"({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    assert "producer.max_groups=6 reached" in err and "the data ran out at step 1 of 40" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["total_steps"] == 40 and not summary["finished"]
    assert "the data ran out at step 1 of 40" in summary["stop_reason"]
    final = run_dir / "checkpoints" / "final"
    assert summary["final_checkpoint"] == str(final) and list(final.glob("*.safetensors"))
    for name in ("reward", "staleness", "throughput", "time_split"):
        assert (run_dir / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert _run_processes(run_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["engine-0", "producer-0"])
def test_killed_child_stops_the_run(tmp_path, victim, redis_url, experiment):
    # Against an external Redis (`--redis`): the other path of the launcher's Redis handling.
    proc = _start(tmp_path, "total_train_steps=1000", f"experiment_name={experiment}", "launcher.sft_steps=0",
                  "launcher.eval_n=0", "--redis", redis_url)
    run_dir = tmp_path / "runs" / experiment / "run0"
    try:
        # Wait until training is under way (a step was logged): every child is up.
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, f"run ended early: {proc.communicate()}"
            assert time.monotonic() < deadline, "no train step within 300s"
            time.sleep(0.5)
        ports = _ports_of_run(run_dir, with_redis=False)  # the external Redis stays up
        assert ports
        role = victim.split("-")[0]
        cmd = {"engine": "serve", "producer": "produce"}[role]
        targets = [p for p in _run_processes(run_dir)
                   if cmd in p.cmdline() and "rlstream.launcher.cli" in " ".join(p.cmdline())]
        assert len(targets) == 1, [p.cmdline() for p in targets]
        victim_pid = targets[0].pid
        os.kill(victim_pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 1, (out[-2000:], err[-2000:])
    reason = [ln for ln in err.splitlines() if ln.startswith("rlstream: run stopped:")]
    assert reason, err[-2000:]
    assert f"{victim} (pid {victim_pid}) was killed by SIGKILL" in reason[0]
    assert _run_processes(run_dir) == []
    for port in ports:
        assert _port_free(port), f"port {port} still bound after the run stopped"
    assert "redis: using redis://127.0.0.1:" in out  # the external one, not a started one
    assert not (run_dir / "logs" / "redis.log").exists()
    # Stopped early, the run still reports what it trained (the trainer saved it as `final`).
    summary = json.loads((run_dir / "summary.json").read_text())
    assert victim in summary["stop_reason"] and not summary["finished"] and summary["steps"] >= 1
    assert summary["final_checkpoint"] and list((run_dir / "checkpoints" / "final").glob("*.safetensors"))
    if role == "engine":
        # The surviving producer was told to release its leases (a failed run trains none of its rollouts), not
        # left to drain rollouts no engine serves until SIGKILL left its leases to expire.
        client = redis.Redis.from_url(redis_url)
        assert client.zcard(Keys(namespace(experiment, "run0")).admit_running) == 0


def test_live_view_renders_a_snapshot():
    from rich.console import Console

    from rlstream.launcher.live import Snapshot, line, render

    snap = Snapshot(t=75.0, step=12, total_steps=200, served_version=12, trainer_version=13, reward=0.625,
                    accuracy=0.625, staleness_mean=0.75, staleness_max=1, staleness_run_mean=0.5, staleness_run_max=1,
                    queue_depth=5, running=8, accepted=123456, rejected=12345, dead=123, dropped_stale=12345,
                    rollouts_per_s=41.5, tokens_per_s=410.0, eta_s=130.0,
                    children={"engine-0": "up", "trainer": "up", "producer-0": "up"})
    console = Console(record=True, width=160)
    console.print(render(snap, "rlstream run demo"))
    text = console.export_text()
    for want in ("12/200", "served 12", "trainer 13", "0.625", "5 groups waiting", "41.5 samples/s",
                 "410 tokens/s", "2m10s", "engine-0:up", "run mean 0.50 max 1   last step 0.75",
                 "accepted 123456 (net of drops)", "dropped 12345"):
        assert want in text, want
    # An 80-column terminal shows the same box: no row wraps onto a second line.
    narrow = Console(record=True, width=80)
    narrow.print(render(snap, "rlstream run demo"))
    assert narrow.export_text().splitlines() == text.splitlines()
    assert "step 12/200 v12 (trainer v13) reward 0.625" in line(snap)


@pytest.mark.slow
def test_sft_cli_prepares_the_demo_and_warm_starts_once(tmp_path):
    """`rlstream sft` on a fresh folder builds the demo data + model, trains, and a second
    call is a no-op (the marker), so `rlstream run` never warm-starts twice."""
    from safetensors.torch import load_file

    args = [sys.executable, "-m", "rlstream.launcher.cli", "sft", "--config", str(CONFIG),
            f"cluster.fileroot={tmp_path / 'runs'}", "launcher.demo.n_train=128", "launcher.demo.n_valid=8",
            "launcher.sft_steps=5", "launcher.sft_batch_size=16"]
    model = tmp_path / "runs" / "tiny-cpu" / "run0" / "model"
    first = subprocess.run(args, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    data = tmp_path / "runs" / "tiny-cpu" / "run0" / "data"
    rows = [json.loads(x) for x in (data / "sft.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    assert len(rows) == len(train) == 128
    assert all(t["answer"] == t["prompt"][:-1][::-1] for t in train)
    # the imperfect teacher: about 70% echoes, the rest reverses
    echoes = sum(r["answer"] == r["prompt"][:-1] and r["answer"] != r["prompt"][:-1][::-1] for r in rows)
    assert 0.5 < echoes / len(rows) < 0.9
    valid = {json.loads(x)["prompt"] for x in (data / "valid.jsonl").read_text().splitlines()}
    assert len(valid) == 8 and not valid & {t["prompt"] for t in train}
    marker = json.loads((model / "rlstream_sft.json").read_text())
    assert marker["steps"] == 5 and marker["examples"] == 128
    weights = load_file(str(model / "model.safetensors"))
    from rlstream.launcher.tiny import build_tiny_model

    init = load_file(str(build_tiny_model(tmp_path / "init", hidden_size=64, num_layers=2, intermediate_size=256,
                                          seed=1) / "model.safetensors"))
    assert any(not (init[k] == weights[k]).all() for k in weights)  # the warm start trained the demo's model
    second = subprocess.run(args, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "already warm-started" in second.stderr
    again = load_file(str(model / "model.safetensors"))
    assert all((weights[k] == again[k]).all() for k in weights)


@pytest.mark.slow
def test_tools_demo_runs_end_to_end(tmp_path):
    """`configs/tools-cpu.yaml`, small: multi-turn warm start, episodes with the calculator, RL steps,
    held-out accuracy and tool-call rate before/after, the agent plot."""
    args = [sys.executable, "-m", "rlstream.launcher.cli", "run", "--config", str(ROOT / "configs" / "tools-cpu.yaml"),
            f"cluster.fileroot={tmp_path / 'runs'}", "launcher.demo.n_train=128", "launcher.demo.n_valid=8",
            "launcher.eval_n=8", "launcher.sft_steps=10", "rollout.consumer_batch_size=2", "gconfig.n_samples=2",
            "total_train_steps=2", "stats_logger.tensorboard.enabled=false"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        _stop(proc)
    run_dir = tmp_path / "runs" / "tools-cpu" / "run0"
    assert proc.returncode == 0, f"rlstream run failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["agent/tool_call_rate"] <= 1 and r["agent/turns"] >= 1 for r in rows)
    assert "held-out accuracy: " in out and " before RL -> " in out
    assert "held-out tool-call rate: " in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 <= summary["tool_call_rate_before"] <= 1 and 0 <= summary["tool_call_rate_after"] <= 1
    png = run_dir / "plots" / "agent.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _run_processes(run_dir) == []


def test_thread_counts_per_child():
    """`launcher.threads`: the trainer's processes share the cores (0 = auto), engines and producers get their own."""
    from rlstream.common.config import load_config
    from rlstream.launcher.procs import thread_env, trainer_threads

    cores = len(os.sched_getaffinity(0))
    cfg = load_config(None, [])
    assert trainer_threads(cfg.launcher) == cores and cfg.launcher.threads.engine == cfg.launcher.threads.producer == 1
    assert trainer_threads(load_config(None, ["launcher.n_trainer_procs=4"]).launcher) == max(1, cores // 4)
    assert trainer_threads(load_config(None, ["launcher.threads.trainer=3"]).launcher) == 3
    assert thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
    assert trainer_threads(load_config(CONFIG, []).launcher) == 1  # the tiny demo: the engine is its bottleneck


def _commit(client, tag: str) -> None:
    """What an admission commit persists: one MULTI/EXEC block with a counter and a large stream entry."""
    pipe = client.pipeline(transaction=True)
    pipe.incr("accepted")
    pipe.xadd("traj", {"d": tag * 50_000})
    pipe.execute()


def _consistent(client) -> tuple[int, int]:
    return int(client.get("accepted") or 0), client.xlen("traj")


def test_repair_torn_aof_cuts_a_transaction_a_crash_tore_off_the_tail(tmp_path):
    # A SIGKILL in the middle of redis-server's write() of a commit's block: the AOF ends inside its XADD.
    # Redis 7.0 alone keeps MULTI + INCR of it, and applies them with the next EXEC after one more restart.
    import redis

    from rlstream.launcher.local import repair_torn_aof
    from tests.helpers import RedisServer

    assert repair_torn_aof(tmp_path / "none") is None
    server = RedisServer(tmp_path / "redis", extra=["--appendonly", "yes", "--appendfsync", "always"]).start()

    def restart() -> redis.Redis:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        server.start()  # RedisServer.start repairs the AOF first, as the launcher does
        return redis.Redis(port=server.port)

    try:
        client = redis.Redis(port=server.port)
        _commit(client, "a")
        _commit(client, "b")
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        incr = sorted((tmp_path / "redis" / "appendonlydir").glob("*.incr.aof"))[-1]
        data = incr.read_bytes()
        incr.write_bytes(data[:data.rindex(b"XADD") + 20_000])  # torn inside the last block's XADD
        assert repair_torn_aof(tmp_path / "redis").startswith("This will shrink")
        tail = incr.read_bytes()
        assert tail.rindex(b"EXEC") > tail.rindex(b"MULTI"), "the torn block's MULTI is still in the AOF"
        assert repair_torn_aof(tmp_path / "redis") is None  # nothing left to cut
        server.start()
        client = redis.Redis(port=server.port)
        assert _consistent(client) == (1, 1)
        _commit(client, "c")
        assert _consistent(restart()) == (2, 2)
    finally:
        server.stop()


@pytest.mark.slow
def test_reward_model_demo_trains_a_reward_model_then_rl_runs_with_its_scoring_pool(tmp_path):
    config = ROOT / "configs" / "reward-model-cpu.yaml"
    common = [f"cluster.fileroot={tmp_path / 'runs'}", *SMALL]
    rw = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "rw", "--config", str(config), *common,
                         "rw.steps=20"], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert rw.returncode == 0, rw.stderr[-3000:]
    assert "held-out pair accuracy" in rw.stdout
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.launcher.cli", "run", "--config", str(config), *common,
                             "total_train_steps=3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=tmp_path, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        _stop(proc)
    run_dir = tmp_path / "runs" / "reward-model-cpu" / "run0"
    assert proc.returncode == 0, f"rlstream run failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    assert "scoring engines: reward_model-0 127.0.0.1:" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # every trained sample was scored by the pool, and its reward is the score alone (rule_weight 0)
    assert all(r["rm/score_mean"] == pytest.approx(r["reward/mean"], abs=1e-4) and r["rm/latency"] > 0 for r in rows)
    assert "reward model: " in (run_dir / "logs" / "producer-0.log").read_text()
    assert (run_dir / "logs" / "reward_model-0.log").stat().st_size > 0
    assert _run_processes(run_dir) == []


@pytest.mark.slow
def test_a_reward_model_not_trained_yet_is_one_line_before_anything_starts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "run", "--config",
                        str(ROOT / "configs" / "reward-model-cpu.yaml"), f"cluster.fileroot={tmp_path / 'runs'}", *SMALL,
                        "launcher.sft_steps=0"], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert r.returncode == 2
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("rlstream: error:")]
    assert len(err) == 1 and "reward_model.pool.model_path=" in err[0] and "rlstream rw" in err[0], r.stderr[-2000:]
    assert not (tmp_path / "runs" / "reward-model-cpu" / "run0" / "logs" / "engine-0.log").exists()


@pytest.mark.slow
def test_rlstream_run_starts_the_judge_pool_and_trains_on_judged_groups(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.launcher.cli", "run", "--config",
                             str(ROOT / "configs" / "tiny-cpu.yaml"), f"cluster.fileroot={tmp_path / 'runs'}", *SMALL,
                             "total_train_steps=2", "judge.pool.model_path=${actor.path}", "judge.max_new_tokens=4",
                             "judge.on_unparseable=rule_reward", "judge.weight=0", "judge.rule_weight=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        _stop(proc)
    run_dir = tmp_path / "runs" / "tiny-cpu" / "run0"
    assert proc.returncode == 0, f"rlstream run failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    assert "scoring engines: judge-0 127.0.0.1:" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # every trained group was judged: its latency logged, its unparseable answers counted (never a silent 0)
    assert all(r["judge/latency"] > 0 and r["judge/failures"] >= 0 for r in rows)
    assert "judge: " in (run_dir / "logs" / "producer-0.log").read_text()
    assert (run_dir / "logs" / "judge-0.log").stat().st_size > 0
    assert _run_processes(run_dir) == []
