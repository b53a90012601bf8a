"""Producer dataset: local JSONL/Parquet/CSV, reasoning-gym tasks, keys, chat template, epochs, seeded order, shared cursor."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlstream.common.config import ConfigError, DatasetConfig
from rlstream.broker.producers import ProducerState
from rlstream.producer.dataset import DatasetCursor, DatasetError, PromptDataset


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)


def _rows(n):
    return [{"q": f"{i}+1=", "a": str(i + 1), "extra": i} for i in range(n)]


def _write(tmp_path, kind, rows):
    if kind == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "csv":
        p = tmp_path / "d.csv"
        p.write_text("q,a,extra\n" + "".join(f"{r['q']},{r['a']},{r['extra']}\n" for r in rows))
    else:
        p = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), p)
    return p


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_formats_keys_and_tokenization(kind, tmp_path, tokenizer):
    p = _write(tmp_path, kind, _rows(5))
    ds = PromptDataset(DatasetConfig(path=str(p), prompt_key="q", answer_key="a", shuffle=False), tokenizer)
    assert len(ds) == 5
    item = ds.at(3)
    assert item.prompt == "3+1=" and str(item.answer) == "4" and item.epoch == 0 and item.index == 3
    assert item.input_ids == tokenizer("3+1=")["input_ids"]
    assert tokenizer.decode(item.input_ids) == "3+1="
    assert item.row["extra"] == 3


def test_folder_and_max_prompt_len(tmp_path, tokenizer):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"q": "1+1=", "a": "2"}) + "\n")
    (d / "b.jsonl").write_text(json.dumps({"q": "12345+67890=", "a": "80235"}) + "\n")
    ds = PromptDataset(DatasetConfig(path=str(d), prompt_key="q", answer_key="a", max_prompt_len=6), tokenizer)
    assert len(ds) == 1 and ds.at(0).prompt == "1+1="


def test_epochs_and_seeded_shuffle(tmp_path, tokenizer):
    p = _write(tmp_path, "jsonl", _rows(20))
    cfg = DatasetConfig(path=str(p), prompt_key="q", answer_key="a", shuffle=True)
    a, b = PromptDataset(cfg, tokenizer, seed=7), PromptDataset(cfg, tokenizer, seed=7)
    order_a = [a.at(i).index for i in range(40)]
    assert order_a == [b.at(i).index for i in range(40)]  # same in every process
    assert sorted(order_a[:20]) == list(range(20)) and sorted(order_a[20:]) == list(range(20))  # full epochs
    assert order_a[:20] != order_a[20:]  # reshuffled per epoch
    assert order_a[:20] != list(range(20))
    assert [a.at(i).epoch for i in (0, 19, 20, 39)] == [0, 0, 1, 1]
    c = PromptDataset(cfg, tokenizer, seed=8)
    assert [c.at(i).index for i in range(20)] != order_a[:20]


def test_chat_template(tmp_path, tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    p = _write(tmp_path, "jsonl", _rows(2))
    with pytest.raises(DatasetError, match="no chat template"):
        PromptDataset(DatasetConfig(path=str(p), prompt_key="q", answer_key="a", apply_chat_template=True), tok)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    ds = PromptDataset(DatasetConfig(path=str(p), prompt_key="q", answer_key="a", apply_chat_template=True,
                                     shuffle=False), tok)
    assert ds.at(1).prompt == "<u>1+1=<a>"
    assert tok.decode(ds.at(1).input_ids) == "<u>1+1=<a>"
    # A column of chat messages gets the template even without apply_chat_template.
    msgs = tmp_path / "m.jsonl"
    msgs.write_text(json.dumps({"q": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}],
                                "a": "4"}) + "\n")
    ds = PromptDataset(DatasetConfig(path=str(msgs), prompt_key="q", answer_key="a"), tok)
    assert ds.at(0).prompt == "<s>be brief<u>2+2=<a>"


# A template that branches on a chat_template_kwargs variable, as Qwen3's does on enable_thinking.
THINKING_TEMPLATE = ("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}"
                     "{% if enable_thinking is defined and not enable_thinking %}a:no think:{% else %}a:{% endif %}"
                     "{% endif %}")


def test_chat_template_path_and_kwargs(tmp_path, tokenizer):
    """train_dataset.chat_template_path replaces the tokenizer's template (none here) and implies applying it; the
    prompt tokens decode to that template's rendering, with chat_template_kwargs as its variables."""
    p = _write(tmp_path, "jsonl", _rows(2))
    template = tmp_path / "chat.jinja"
    template.write_text(THINKING_TEMPLATE)

    def prompt(**kwargs):
        ds = PromptDataset(DatasetConfig(path=str(p), prompt_key="q", answer_key="a", shuffle=False,
                                         chat_template_path=str(template), **kwargs), tokenizer)
        assert tokenizer.decode(ds.at(1).input_ids) == ds.at(1).prompt
        return ds.at(1).prompt

    assert prompt() == "[1+1=]a:"
    assert prompt(chat_template_kwargs={"enable_thinking": True}) == "[1+1=]a:"
    assert prompt(chat_template_kwargs={"enable_thinking": False}) == "[1+1=]a:no think:"
    with pytest.raises(ConfigError, match=r"train_dataset.chat_template_path='/nowhere/chat.jinja': cannot read"):
        PromptDataset(DatasetConfig(path=str(p), chat_template_path="/nowhere/chat.jinja"), tokenizer)


def test_clear_errors(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="train_dataset.path is empty"):
        PromptDataset(DatasetConfig(path=""), tokenizer)
    with pytest.raises(DatasetError, match=r"'rlstream-tests/absent' is not in the local HF datasets cache"):
        PromptDataset(DatasetConfig(path="rlstream-tests/absent"), tokenizer)
    with pytest.raises(DatasetError, match=r"'data/absent.jsonl' does not exist"):
        PromptDataset(DatasetConfig(path="data/absent.jsonl"), tokenizer)
    p = _write(tmp_path, "jsonl", _rows(2))
    with pytest.raises(DatasetError, match=r"prompt_key='question' is not a column.*\['a', 'extra', 'q'\]"):
        PromptDataset(DatasetConfig(path=str(p), prompt_key="question"), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DatasetError, match="cannot read as json"):
        PromptDataset(DatasetConfig(path=str(bad)), tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .jsonl"):
        PromptDataset(DatasetConfig(path=str(tmp_path / "empty")), tokenizer)


async def test_shared_cursor_resumes_and_ends(tmp_path, tokenizer, redis_url, keys):
    import msgspec

    from rlstream.broker import connect_async

    p = _write(tmp_path, "jsonl", _rows(3))
    ds = PromptDataset(DatasetConfig(path=str(p), prompt_key="q", answer_key="a"), tokenizer, seed=1)
    client = await connect_async(redis_url)
    try:
        a = DatasetCursor(client, keys, ds, epochs=2, producer_id="pa")
        b = DatasetCursor(client, keys, ds, epochs=2, producer_id="pb")
        got = [(await a.next()).position, (await b.next()).position, (await a.next()).position]
        assert got == [0, 1, 2]
        await a.save()
        # A restarted producer (same id) continues the run's position and keeps its counters.
        a2 = DatasetCursor(client, keys, ds, epochs=2, producer_id="pa")
        st = await a2.load_state()
        assert st.claimed == 2 and st.last_position == 2
        rest = [await a2.next(), await b.next(), await a2.next()]
        assert [i.position for i in rest] == [3, 4, 5] and all(i.epoch == 1 for i in rest)
        assert await a2.next() is None and await b.next() is None  # 2 epochs x 3 prompts handed out
        raw = await client.hget(keys.producers, "pa")
        assert msgspec.msgpack.decode(raw, type=ProducerState).producer_id == "pa"
    finally:
        await client.aclose()


async def test_stale_drops_give_prompts_back_and_no_epoch_limit(tmp_path, tokenizer, redis_url, keys, rclient,
                                                                 group_factory):
    """Each group the trainer dropped as stale extends the epochs by a prompt; epochs=None never ends."""
    from rlstream.broker import TrajectoryStream, connect_async

    p = _write(tmp_path, "jsonl", _rows(3))
    ds = PromptDataset(DatasetConfig(path=str(p), prompt_key="q", answer_key="a"), tokenizer, seed=1)
    client = await connect_async(redis_url)
    try:
        cur = DatasetCursor(client, keys, ds, epochs=1, producer_id="pa")
        assert [(await cur.next()).position for _ in range(3)] == [0, 1, 2]
        assert await cur.next() is None  # position 3: one epoch handed out, nothing dropped
        # The trainer drops two groups as stale (the real path: stream entry -> drop_stale).
        stream = TrajectoryStream(rclient, keys)
        stream.ensure_group()
        for i in range(2):
            stream.append(group_factory(prompt_id=f"g{i}"))
        for entry in stream.read("c0", count=2, block_ms=100):
            stream.drop_stale(entry, 5, "head staleness 5 > max_head_offpolicyness 1")
        assert rclient.xlen(keys.dropped) == 2
        item = await cur.next()  # position 4 < 3 + 2 drops
        assert item is not None and item.position == 4 and item.epoch == 1
        assert await cur.next() is None  # position 5 = 3 + 2
        endless = DatasetCursor(client, keys, ds, epochs=None, producer_id="pb")
        positions = [(await endless.next()).position for _ in range(7)]
        assert positions == list(range(6, 13)) and ds.at(12).epoch == 4
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- reasoning-gym tasks

CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def _rg(seed: int, size: int = 30, **kw) -> DatasetConfig:
    return DatasetConfig(source="reasoning_gym", task="chain_sum", size=size, seed=seed, config=dict(CHAIN), **kw)


def _snapshot(ds: PromptDataset, n: int) -> list[tuple]:
    return [(i.index, i.epoch, i.prompt, i.input_ids, json.dumps(i.answer, sort_keys=True))
            for i in (ds.at(p) for p in range(n))]


@pytest.fixture(scope="module")
def chat_tokenizer():
    from rlstream.launcher.tiny import build_tokenizer

    return build_tokenizer(chat=True)


def test_generated_rows_are_identical_in_every_process_and_differ_for_the_held_out_seed(chat_tokenizer, tmp_path):
    a, b = PromptDataset(_rg(4), chat_tokenizer, seed=9), PromptDataset(_rg(4), chat_tokenizer, seed=9)
    assert len(a) == 30 and _snapshot(a, 75) == _snapshot(b, 75)  # 2.5 epochs in the same shuffled order
    item = a.at(0)
    assert item.prompt.startswith("u:") and item.prompt.endswith("a:") and "<answer>" in item.prompt
    assert item.prompt.count("u:") == 2  # the solved example, then the problem
    assert item.row["question"] in item.prompt and item.answer["task"] == "chain_sum"
    code = ("import json, sys; from rlstream.common.config import DatasetConfig; "
            "from rlstream.launcher.tiny import build_tokenizer; from rlstream.producer.dataset import PromptDataset; "
            f"ds = PromptDataset(DatasetConfig(source='reasoning_gym', task='chain_sum', size=30, seed=4, config={CHAIN!r}), "
            "build_tokenizer(chat=True), seed=9); "
            "print(json.dumps([(i.index, i.epoch, i.prompt, i.input_ids, json.dumps(i.answer, sort_keys=True)) "
            "for i in (ds.at(p) for p in range(75))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert [tuple(r) for r in json.loads(out.stdout)] == _snapshot(a, 75)
    held_out = PromptDataset(_rg(34, shuffle=False), chat_tokenizer, seed=9, key="valid_dataset")
    train_q = {a.at(p).row["question"] for p in range(30)}
    assert [held_out.at(p).answer["seed"] for p in range(30)] == [34] * 30
    assert [held_out.at(p).row["question"] for p in range(30)] != [a.at(p).row["question"] for p in range(30)]
    assert len({held_out.at(p).row["question"] for p in range(30)} - train_q) >= 25  # chance repeats of short sums only


async def test_two_producers_share_one_pass_over_generated_rows(chat_tokenizer, redis_url, keys):
    from rlstream.broker import connect_async

    client = await connect_async(redis_url)
    try:
        # Each producer builds its own dataset; the shared cursor hands out positions of one order.
        a = DatasetCursor(client, keys, PromptDataset(_rg(4, size=6), chat_tokenizer), epochs=1, producer_id="pa")
        b = DatasetCursor(client, keys, PromptDataset(_rg(4, size=6), chat_tokenizer), epochs=1, producer_id="pb")
        got = [await c.next() for c in (a, b, a, b, a, b)]
        assert await a.next() is None and await b.next() is None
        assert sorted(i.answer["index"] for i in got) == list(range(6))
    finally:
        await client.aclose()


def test_generated_source_errors_name_the_key(chat_tokenizer):
    with pytest.raises(DatasetError, match=r"^valid_dataset.task='chainsum' is not a reasoning-gym task; close names: chain_sum"):
        PromptDataset(DatasetConfig(source="reasoning_gym", task="chainsum"), chat_tokenizer, key="valid_dataset")
    with pytest.raises(DatasetError, match=r"train_dataset.config.max_term is not an option"):
        PromptDataset(DatasetConfig(source="reasoning_gym", task="chain_sum", config={"max_term": 3}), chat_tokenizer)
    with pytest.raises(DatasetError, match="train_dataset.source=reasoning_gym needs train_dataset.task"):
        PromptDataset(DatasetConfig(source="reasoning_gym"), chat_tokenizer)


def test_gconfig_max_tokens_drops_prompts_that_leave_no_token(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": "1" * n, "answer": "x"}) + "\n" for n in (2, 5, 9)))
    lens = sorted(len(PromptDataset(DatasetConfig(path=str(p)), tokenizer).at(i).input_ids) for i in range(3))
    ds = PromptDataset(DatasetConfig(path=str(p), shuffle=False), tokenizer, max_total_tokens=lens[1] + 1)
    assert sorted(len(ds.at(i).input_ids) for i in range(len(ds))) == lens[:2]  # the longest leaves no token
    capped = PromptDataset(DatasetConfig(path=str(p), max_prompt_len=lens[0]), tokenizer, max_total_tokens=100)
    assert len(capped) == 1


# ---------------------------------------------------------------------------- images (vision-language models)

@pytest.fixture(scope="module")
def vlm(tiny_vlm_path):
    from transformers import AutoTokenizer

    from rlstream.common.vision import vision_spec

    return AutoTokenizer.from_pretrained(tiny_vlm_path, local_files_only=True), vision_spec(tiny_vlm_path)


def test_rows_with_image_paths_bytes_and_chat_parts_become_prompts_with_images(tmp_path, vlm):
    import base64

    from rlstream.common.images import image_sha256
    from tests.helpers import shape_png

    tok, spec = vlm
    red, blue = shape_png("red"), shape_png("blue", size=112)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(red)
    url = "data:image/png;base64," + base64.b64encode(blue).decode()
    rows = [{"prompt": "colour?", "images": ["img/red.png"], "answer": "red"},  # a path, relative to the data
            {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "colour?"}]}], "answer": "blue"},
            {"prompt": "colour?", "images": ["img/missing.png"], "answer": "x"},  # skipped, named
            {"prompt": "plain", "answer": "none"}]  # a text row next to image rows
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset(DatasetConfig(path=str(p), shuffle=False), tok, vision=spec)
    items = [ds.at(i) for i in range(len(ds))]
    assert [it.index for it in items] == [0, 1, 3]
    assert [it.images for it in items] == [(red,), (blue,), ()]
    assert [it.input_ids.count(spec.image_token_id) for it in items] == [4, 16, 0]
    assert items[0].prompt == "u:<|vision_start|><|image_pad|><|vision_end|>colour?\na:"
    assert ds.image_bytes == {image_sha256(red): red, image_sha256(blue): blue}


def test_hf_image_feature_rows_in_parquet(tmp_path, vlm):
    import datasets

    from tests.helpers import shape_png

    tok, spec = vlm
    feats = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string"),
                               "images": datasets.Sequence(datasets.Image())})
    ds_in = datasets.Dataset.from_dict({"prompt": ["which?", "which?"], "answer": ["red", "green"],
                                        "images": [[{"bytes": shape_png("red"), "path": None}],
                                                   [{"bytes": shape_png("green"), "path": None}]]}, features=feats)
    ds_in.to_parquet(str(tmp_path / "d.parquet"))
    ds = PromptDataset(DatasetConfig(path=str(tmp_path / "d.parquet"), shuffle=False), tok, vision=spec)
    got = [ds.at(i) for i in range(2)]
    from rlstream.common.images import open_image

    # decoded by datasets into PIL images, saved again as PNG: the same pixels
    assert [open_image(it.images[0]).getpixel((28, 28)) for it in got] == [(255, 0, 0), (0, 128, 0)]
    assert all(it.input_ids.count(spec.image_token_id) == 4 for it in got)


def test_image_rows_for_a_text_model_or_all_bad_are_one_line(tmp_path, vlm, tokenizer):
    tok, spec = vlm
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "c?", "images": ["nope.png"], "answer": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"^train_dataset: row 0 has images, but the model is text-only"):
        PromptDataset(DatasetConfig(path=str(p)), tokenizer)
    with pytest.raises(DatasetError, match=r"no usable prompts \(1 rows, 0 too long, 1 with unusable images\)"):
        PromptDataset(DatasetConfig(path=str(p)), tok, vision=spec)


def test_rows_over_the_image_limits_are_skipped_with_one_line_naming_them(tmp_path, vlm):
    """images.max_per_prompt / max_pixels / max_bytes: a row over one is skipped with a line naming the row and the
    key; rows within them stay."""
    from rlstream.common.config import ImageLimitsConfig
    from tests.helpers import shape_png

    tok, spec = vlm
    small, big = shape_png("red"), shape_png("blue", size=112)
    for name, data in (("small.png", small), ("big.png", big)):
        (tmp_path / name).write_bytes(data)
    rows = [{"prompt": "c?", "images": ["small.png"], "answer": "red"},
            {"prompt": "c?", "images": ["small.png", "small.png"], "answer": "x"},  # 2 images: over 1
            {"prompt": "c?", "images": ["big.png"], "answer": "x"}]  # 112x112 = 12,544 pixels: over 56x56
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    limits = ImageLimitsConfig(max_per_prompt=1, max_pixels=56 * 56)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("rlstream.producer.dataset")  # rlstream's loggers do not propagate to caplog
    logger.addHandler(handler)
    try:
        ds = PromptDataset(DatasetConfig(path=str(p), shuffle=False), tok, vision=spec, image_limits=limits)
    finally:
        logger.removeHandler(handler)
    assert [ds.at(i).index for i in range(len(ds))] == [0]
    text = "\n".join(lines)
    assert "train_dataset row 1: 2 images, over images.max_per_prompt=1 (row skipped)" in text
    assert "train_dataset row 2 image 0: 112x112 = 12,544 pixels, over images.max_pixels=3,136 (row skipped)" in text
    tight = ImageLimitsConfig(max_bytes=len(small) - 1)
    with pytest.raises(DatasetError, match=r"no usable prompts \(3 rows, 0 too long, 3 with unusable images\)"):
        PromptDataset(DatasetConfig(path=str(p)), tok, vision=spec, image_limits=tight)
