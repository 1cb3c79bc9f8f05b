"""Training of the bundled demo models: corpus, tokenizer, loop, checkpoint export, the shipped models."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.model import load_model
from engine.tokenizer import Tokenizer as EngineTokenizer
from engine.train import (
    DemoRecipe,
    TrainConfig,
    build_model,
    chat_text,
    draft_hf_config,
    moe_hf_config,
    perplexity,
    save_checkpoint,
    save_tokenizer,
    train,
    train_demo_models,
    train_tokenizer,
)
from engine.train.balance import RouterBalance
from engine.train.data import (
    END_OF_TEXT,
    Document,
    arc_documents,
    gsm8k_documents,
    leetcode_documents,
    load_documents,
    mbpp_documents,
    nq_documents,
    shakespeare_documents,
    split_documents,
)
from engine.train.loop import lr_at

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "engine" / "models"

TEXTS = [
    "The cat sat on the mat. 12 + 30 = 42.",
    "def add(a, b):\n    return a + b\n",
    "To be, or not to be, that is the question.",
    "中文文本也应该能够被编码。你好，世界！",
] * 20


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A miniature shared-data folder with every file the corpus builder reads."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "MANIFEST.md").write_text("# test data\n")
    _write_jsonl(d / "gsm8k/train.jsonl", [
        {"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
         "answer": f"He has {i}+{i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1} apples.\n#### {2 * i + 1}"}
        for i in range(40)])
    _write_jsonl(d / "math/MATH_test_5000.jsonl", [
        {"problem": f"What is ${i}^2$?", "solution": f"${i}^2 = \\boxed{{{i * i}}}$.", "level": "Level 1"}
        for i in range(20)])
    _write_jsonl(d / "mbpp/mbpp.jsonl", [
        {"text": "Write a function to add two numbers.", "code": "def add(a, b):\r\n\treturn a + b",
         "test_list": ["assert add(1, 2) == 3"]}])
    _write_jsonl(d / "self_instruct/seed_tasks.jsonl", [
        {"instruction": "Give an antonym.", "instances": [{"input": "hot", "output": "cold"}]}])
    _write_jsonl(d / "self_instruct/user_oriented_instructions.jsonl", [
        {"instruction": "Say hello.", "instances": [{"input": "", "output": "Hello!"}]}])
    _write_jsonl(d / "nq_open/NQ-open.dev.jsonl", [{"question": "who wrote hamlet", "answer": ["Shakespeare"]}])
    _write_jsonl(d / "nq_open/NQ-open.efficientqa.dev.1.1.jsonl",
                 [{"question": "capital of france", "answer": ["Paris"]}])
    arc = {"id": "x", "question": {"stem": "Which is a gas?", "choices": [
        {"label": "A", "text": "ice"}, {"label": "B", "text": "steam"}]}, "answerKey": "B"}
    _write_jsonl(d / "arc/ARC-Easy-Train.jsonl", [arc])
    _write_jsonl(d / "arc/ARC-Challenge-Train.jsonl", [arc])
    _write_jsonl(d / "leetcode/leetcode_train.jsonl", [
        {"task_id": "two-sum", "problem": "Return indices.\nPlease complete the following python code precisely:"
         "\n```python\nclass Solution: ...\n```", "solution": "class Solution:\n    pass"}])
    play = "\n\n".join(f"ROMEO:\nLine {i} of love and woe,\nand more of it." for i in range(60))
    (d / "corpus").mkdir()
    (d / "corpus/tinyshakespeare.txt").write_text(play, encoding="utf-8")
    return d


# --- corpus -------------------------------------------------------------------------------

def test_formatters_render_question_and_worked_answer() -> None:
    [g] = gsm8k_documents([{"question": "Q?", "answer": "Half is 48/2 = <<48/2=24>>24.\n#### 24"}])
    assert "<<" not in g.text and "Half is 48/2 = 24." in g.text and g.text.endswith("The answer is 24.<|im_end|>\n")
    [a] = arc_documents([{"question": {"stem": "Pick.", "choices": [{"label": "A", "text": "x"},
                                                                    {"label": "B", "text": "y"}]},
                          "answerKey": "B"}])
    assert "A. x\nB. y" in a.text and "The answer is B. y" in a.text
    [n] = nq_documents([{"question": "who wrote hamlet", "answer": ["Shakespeare", "W. S."]}])
    assert "Who wrote hamlet?" in n.text and "Shakespeare." in n.text
    [m] = mbpp_documents([{"text": "Add.", "code": "def f():\r\n\treturn 1", "test_list": ["assert f() == 1"]}])
    assert "\r" not in m.text and "    return 1" in m.text and "assert f() == 1" in m.text
    [lc] = leetcode_documents([{"problem": "Do it.\nPlease complete the following python code precisely:\nstub",
                                "solution": "x = 1"}])
    assert "Please complete" not in lc.text and "x = 1" in lc.text
    passages = list(shakespeare_documents("\n\n".join(f"A:\nline {i}" for i in range(30)), passage_lines=10))
    assert len(passages) == 6 and all(p.text.endswith(END_OF_TEXT) for p in passages)


def test_load_documents_reads_every_source(data_dir: Path) -> None:
    sources = {d.source for d in load_documents(data_dir)}
    assert sources == {"gsm8k", "math", "mbpp", "self_instruct", "nq_open", "arc", "leetcode", "shakespeare"}
    with pytest.raises(FileNotFoundError):
        load_documents(data_dir / "missing")


def test_split_is_deterministic_disjoint_and_per_source() -> None:
    docs = [Document("a", f"a{i}") for i in range(100)] + [Document("b", f"b{i}") for i in range(50)]
    one, two = split_documents(docs, 0.1, seed=7), split_documents(docs, 0.1, seed=7)
    assert [d.text for d in one.train] == [d.text for d in two.train]
    assert not {d.text for d in one.train} & {d.text for d in one.validation}
    assert len(one.train) + len(one.validation) == len(docs)
    assert one.sources() == {"a": (90, 10), "b": (45, 5)}
    other = split_documents(docs, 0.1, seed=8)
    assert {d.text for d in other.validation} != {d.text for d in one.validation}


# --- tokenizer ----------------------------------------------------------------------------

def test_tokenizer_round_trips_and_keeps_special_tokens_whole(tmp_path: Path) -> None:
    tok = train_tokenizer(TEXTS, vocab_size=400)
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    for text in ["你好，世界！数学很有趣。", "emoji 🙂 and tabs\t\tand\r\nCRLF", "x = 12345 * 678"]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert len(tok.encode("12345").ids) == 5          # digits are single tokens (Qwen2 split)
    save_tokenizer(tok, tmp_path, model_max_length=64)
    engine_tok = EngineTokenizer.from_dir(tmp_path)
    assert engine_tok.decode(engine_tok.encode("中文 ok"), skip_special_tokens=False) == "中文 ok"


def test_training_text_is_what_the_chat_template_renders(tmp_path: Path) -> None:
    save_tokenizer(train_tokenizer(TEXTS, vocab_size=400), tmp_path, model_max_length=64)
    tok = EngineTokenizer.from_dir(tmp_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    assert prompt + "4<|im_end|>\n" == chat_text("What is 2+2?", "4")


# --- loop and checkpoint ------------------------------------------------------------------

TINY_MOE = moe_hf_config(64, 2, 0, hidden=32, layers=2, experts=4, expert_width=16, context=32)
TINY_DENSE = draft_hf_config(64, 2, 0, hidden=32, layers=1, width=32, context=32)


def test_lr_schedule_warms_up_decays_and_follows_the_clock() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_fraction=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) < 0.11 and lr_at(50, cfg) > lr_at(80, cfg)
    assert lr_at(20, cfg, time_fraction=1.0) == pytest.approx(0.1)


@pytest.mark.parametrize("hf_config", [TINY_MOE, TINY_DENSE], ids=["mixtral", "llama"])
def test_five_steps_reduce_loss_and_write_a_loadable_checkpoint(hf_config: dict, tmp_path: Path) -> None:
    pattern = torch.tensor([5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49], dtype=torch.int32)
    stream = pattern.repeat(60)
    model = build_model(hf_config, seed=0)
    n_experts = hf_config.get("num_local_experts")
    ks = [1, 2] if n_experts else [None]
    before = {k: perplexity(model, stream, 32, k, max_windows=4) for k in ks}
    cfg = TrainConfig(seq_len=32, batch_size=4, steps=5, lr=1e-2, warmup_steps=1, log_every=1, seed=3)
    report = train(model, stream, cfg, num_experts=n_experts, log=lambda _: None,
                   checkpoint=lambda _step: save_checkpoint(model, hf_config, tmp_path))
    assert report.steps == 5 and len(report.losses) == 5
    after = {k: perplexity(model, stream, 32, k, max_windows=4) for k in ks}
    for k in ks:
        assert after[k] < 0.8 * before[k], (k, before, after)

    loaded, config = load_model(tmp_path)       # bf16 on disk -> fp32: equals the bf16-rounded weights
    assert config.model_type == hf_config["model_type"]
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    x, pos = stream[:20].long(), torch.arange(20)
    for k in ks:
        torch.testing.assert_close(loaded(x, pos, experts_per_token=k), model(x, pos, experts_per_token=k),
                                   rtol=0, atol=1e-5)


def test_checkpoint_loads_in_hf_transformers_with_the_same_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = build_model(TINY_MOE, seed=1)
    save_checkpoint(model, TINY_MOE, tmp_path, dtype=torch.float32)
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.arange(3, 23)
    with torch.no_grad():
        theirs = hf(input_ids=x[None]).logits[0]
        ours = model(x, torch.arange(20))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_router_balance_loss_is_differentiable_and_needs_routers() -> None:
    model = build_model(TINY_MOE, seed=2)
    balance = RouterBalance(model, 4)
    balance.reset(2)
    model(torch.arange(10), torch.arange(10), experts_per_token=2)
    loss = balance.loss()
    loss.backward()
    assert loss.item() >= 0.99 and model.model.layers[0].mlp.gate.weight.grad is not None
    balance.close()
    with pytest.raises(ValueError):
        RouterBalance(build_model(TINY_DENSE, seed=0), 4)


def test_recipe_end_to_end_and_eval_command_agree(data_dir: Path, tmp_path: Path) -> None:
    """Tiny recipe on the miniature data folder: files, card, and `tiergate engine eval-ppl` agree."""
    from gateway.cli.engine_cmd import app

    recipe = DemoRecipe(
        data_dir=data_dir, out_dir=tmp_path, vocab_size=300, context=32,
        moe=TrainConfig(seq_len=32, batch_size=2, steps=3, warmup_steps=1, log_every=1),
        draft=TrainConfig(seq_len=32, batch_size=2, steps=2, warmup_steps=1, log_every=1, k_choices=(1,),
                          k_weights=(1.0,)),
        moe_shape=dict(hidden=32, layers=1, experts=4, expert_width=16), draft_shape=dict(hidden=32, layers=1, width=32),
        validation_fraction=0.1)
    results = train_demo_models(recipe, log=lambda _: None)
    for name in ("demo-moe", "demo-draft"):
        files = {p.name for p in (tmp_path / name).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "MODEL_CARD.md"} <= files
    assert (tmp_path / "demo-moe/tokenizer.json").read_bytes() == (tmp_path / "demo-draft/tokenizer.json").read_bytes()
    moe = results["demo-moe"]
    assert moe.params_active[1] < moe.params_active[2] < moe.params_total
    card = (tmp_path / "demo-moe/MODEL_CARD.md").read_text()
    assert "Demo quality" in card and f"{moe.val_ppl[1]:.2f}" in card and "| mbpp | " in card

    out = CliRunner().invoke(app, ["eval-ppl", "--model", str(tmp_path / "demo-moe"), "--k", "1", "--k", "2",
                                   "--data-dir", str(data_dir), "--validation-fraction", "0.1"])
    assert out.exit_code == 0, out.output
    found = {int(k): float(v) for k, v in re.findall(r"k=(\d) perplexity=([\d.]+)", out.output)}
    assert found == pytest.approx(moe.val_ppl, rel=1e-4)    # the card's numbers are the shipped weights'
    assert found[1] != found[2]


# --- the shipped models -------------------------------------------------------------------

def _greedy(model: torch.nn.Module, ids: list[int], steps: int, k: int | None) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor(out), torch.arange(len(out)), experts_per_token=k)
            out.append(int(logits[-1].argmax()))
    return out[len(ids):]


@pytest.mark.skipif(not (MODELS / "demo-moe" / "model.safetensors").exists(), reason="demo model not trained yet")
def test_shipped_demo_models_load_and_generate() -> None:
    sizes = sum((MODELS / n / "model.safetensors").stat().st_size for n in ("demo-moe", "demo-draft"))
    assert sizes <= 40 * 1024 * 1024
    tok = EngineTokenizer.from_dir(MODELS / "demo-moe")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}]),
                        add_special_tokens=False)
    model, config = load_model(MODELS / "demo-moe")
    assert config.is_moe and config.num_experts == 8 and config.num_experts_per_tok == 2
    x, pos = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        assert not torch.equal(model(x, pos, experts_per_token=1), model(x, pos, experts_per_token=2))
    for k in (1, 2):
        tokens = _greedy(model, prompt, 4, k)
        assert len(tokens) == 4 and all(0 <= t < config.vocab_size for t in tokens)
        assert isinstance(tok.decode(tokens), str)
    draft, draft_config = load_model(MODELS / "demo-draft")
    assert not draft_config.is_moe and draft_config.vocab_size == config.vocab_size
    assert (MODELS / "demo-draft/tokenizer.json").read_bytes() == (MODELS / "demo-moe/tokenizer.json").read_bytes()
    assert len(_greedy(draft, prompt, 4, None)) == 4


@pytest.mark.slow
def test_train_command_writes_a_model_directory(data_dir: Path, tmp_path: Path) -> None:
    from gateway.cli.engine_cmd import app

    out = CliRunner().invoke(app, ["train", "--out", str(tmp_path), "--data-dir", str(data_dir), "--which", "moe",
                                   "--moe-steps", "1"])
    assert out.exit_code == 0, out.output
    assert "step 1/1" in out.output and not (tmp_path / "demo-draft").exists()
    _, config = load_model(tmp_path / "demo-moe")
    assert config.model_type == "mixtral" and config.num_experts == 8
    assert "--moe-steps 1 " in (tmp_path / "demo-moe/MODEL_CARD.md").read_text()
