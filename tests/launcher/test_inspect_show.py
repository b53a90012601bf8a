"""`rlstream inspect --show` / `--dead` / `--slowest` (launcher/inspect_show.py) against the real Redis:

- a multi-turn entry reads as its conversation: prompt, model turns with versions and logprob summary,
  the observation between them, rewards and the loss mask's token count; `--json` carries the same;
- the newest N, an entry by id, a dead letter (by its source id) with its reason, and an unknown id (exit 1);
- `--slowest N` orders the session tracer's records by total time and joins the trained step.
(A real run's entries: tests/e2e/test_tracing.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rlstream.broker import TrajectoryStream
from rlstream.broker.keys import Keys
from rlstream.common.config import load_config
from rlstream.common.wire import Trajectory, TrajectoryGroup
from rlstream.launcher.inspect_show import show_main, slowest_sessions
from tests.helpers import child_env


def _agent_group() -> TrajectoryGroup:
    t = Trajectory.from_segments([([5, 6, 7], None, None), ([8, 9], [-0.5, -1.5], [2, 2]), ([10], None, None),
                                  ([11, 12, 13], [-0.1, -0.2, -0.3], [2, 3, 3])], prompt_len=3, reward=1.0,
                                 finish_reason="stop", turn_rewards=[0.25, 0.75], metadata={"turns": 2})
    return TrajectoryGroup(group_id="g-agent", prompt_id="p7", producer_id="producer-0", trajectories=[t])


@pytest.fixture
def stream_cfg(redis_url, rclient, experiment):
    cfg = load_config(None, [f"experiment_name={experiment}", f"redis.url={redis_url}", "actor.path=/nonexistent"])
    stream = TrajectoryStream(rclient, Keys(cfg.namespace))
    stream.ensure_group()
    return cfg, stream


def test_an_entry_reads_as_its_conversation(stream_cfg, capsys):
    cfg, stream = stream_cfg
    entry_id = stream.append(_agent_group())
    assert show_main(cfg, "1") == 0
    out = capsys.readouterr().out
    assert f"entry {entry_id}  group g-agent  prompt p7  producer producer-0  oldest version 2" in out
    assert "sample 1: reward 1, finish stop, loss on 5 of 9 tokens" in out
    lines = [ln.strip() for ln in out.splitlines()]
    turns = [ln for ln in lines if ln.startswith(("prompt:", "model:", "observation:"))]
    assert [t.split(":")[0] for t in turns] == ["prompt", "model", "observation", "model"]
    assert "'ids 8 9'  [2 tok, v2, logprob mean -1.000 min -1.500, turn reward 0.25]" in turns[1]
    assert "[3 tok, v2-v3, logprob mean -0.200 min -0.300, turn reward 0.75]" in turns[3]
    assert show_main(cfg, entry_id, as_json=True) == 0
    (view,) = json.loads(capsys.readouterr().out)
    segs = view["samples"][0]["segments"]
    assert [s["role"] for s in segs] == ["prompt", "model", "observation", "model"]
    assert segs[3]["versions"] == [2, 3] and segs[3]["logprob"]["sum"] == pytest.approx(-0.6, abs=1e-4)
    assert view["samples"][0]["trained_tokens"] == 5 and view["samples"][0]["metadata"] == {"turns": 2}


def test_newest_n_dead_letters_and_unknown_ids(stream_cfg, capsys):
    cfg, stream = stream_cfg
    first = stream.append(_agent_group())
    second = stream.append(_agent_group())
    assert show_main(cfg, "2", as_json=True) == 0
    assert [v["id"] for v in json.loads(capsys.readouterr().out)] == [second, first]
    stream.dead_letter_entry(first, "token id 99999 outside the vocabulary")
    assert show_main(cfg, first, dead=True) == 0
    out = capsys.readouterr().out
    assert "dead letter: token id 99999 outside the vocabulary" in out and "group g-agent" in out
    assert show_main(cfg, "0-1") == 1
    assert "no entry 0-1 in" in capsys.readouterr().out


def test_cli_show_json_parses(stream_cfg):
    cfg, stream = stream_cfg
    stream.append(_agent_group())
    res = subprocess.run([sys.executable, "-m", "rlstream.launcher.cli", "inspect", "--redis", cfg.redis.url,
                          "-n", cfg.namespace, "--show", "1", "--json"], capture_output=True, text=True,
                         env=child_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["group_id"] == "g-agent"


def test_slowest_sessions_order_and_trained_step(tmp_path):
    recs = [{"kind": "rollout", "session": "a", "submit": 10.0, "admitted": 10.5, "end": 12.0, "group_id": "ga",
             "outcome": "committed", "requests": [{"start": 10.6, "end": 11.6}]},
            {"kind": "rollout", "session": "b", "submit": 10.0, "admitted": 10.1, "end": 19.0, "outcome": "dropped",
             "reason": "too stale", "requests": []},
            {"kind": "trained", "group_id": "ga", "step": 4, "at": 13.0}]
    (tmp_path / "sessions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = slowest_sessions(tmp_path, 5)
    assert [r["session"] for r in rows] == ["b", "a"]
    assert rows[1]["trained_step"] == 4 and rows[1]["engine_s"] == pytest.approx(1.0)
    assert rows[1]["admission_s"] == pytest.approx(0.5) and "trained_step" not in rows[0]
    assert np.isclose(rows[0]["total_s"], 9.0)
