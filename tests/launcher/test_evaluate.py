"""`launcher/evaluate.py`: held-out accuracy of a checkpoint, greedy through a local engine in this process
and scored by the run's reward, on the tiny model (single turn) and what an example shows of a prompt."""

from __future__ import annotations

import json

import pytest
import torch

from rlstream.common.config import load_config
from rlstream.launcher.evaluate import evaluate_accuracy, question_of


def test_question_of_a_chat_prompt_is_its_last_user_message():
    row = {"prompt": [{"role": "user", "content": "example"}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "the question"}]}
    assert question_of(row, "prompt", "<templated text>") == "the question"
    assert question_of({"prompt": "12="}, "prompt", "12=") == "12="
    assert question_of({"prompt": "colour?", "images": ["images/00001.png"]}, "prompt", "u:<|...|>") == \
        "[images/00001.png] colour?"
    assert question_of({"prompt": [{"role": "system", "content": "s"}]}, "prompt", "text") == "text"


def test_greedy_accuracy_scores_the_model_completions(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlstream.producer.dataset import PromptDataset

    prompts = ["12=", "34=", "56=", "78="]
    data = tmp_path / "valid.jsonl"
    cfg = load_config(None, [f"actor.path={tiny_model_path}", f"valid_dataset.path={data}",
                             "valid_dataset.shuffle=false", "gconfig.max_new_tokens=3", "server.device=cpu",
                             "producer.reward_fn=rlstream.producer.rewards:exact_match_reward"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    data.write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts))
    ds = PromptDataset(cfg.valid_dataset, tok)
    # The answer of the first two rows is the model's own greedy completion of the ids the dataset gives it.
    rows = []
    for i, (_, text, _, ids, _) in enumerate(ds.items):
        x = torch.tensor([list(ids)])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, x.shape[1]:].tolist()
        out = out[:out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
        greedy = tok.decode(out, skip_special_tokens=True)
        rows.append({"prompt": text, "answer": greedy if i < 2 else greedy + "never"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = evaluate_accuracy(cfg, tiny_model_path, n=4, batch_size=4)
    assert res.n == 4 and res.accuracy == 0.5 and res.mean_reward == 0.5
    assert [q for q, _, _ in res.examples] == prompts
    assert [c for _, c, _ in res.examples[:2]] == [r["answer"] for r in rows[:2]]
    assert res.episode_stats == {}


def test_without_a_held_out_set_it_says_what_to_set(tiny_model_path):
    with pytest.raises(ValueError, match="valid_dataset.path is empty"):
        evaluate_accuracy(load_config(None, [f"actor.path={tiny_model_path}"]), tiny_model_path, n=1)
