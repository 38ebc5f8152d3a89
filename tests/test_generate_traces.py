"""kvpop-traces (kvpop_hf/data/traces.py) on a tiny chat model: batched left-padded sampling, a datasets-loadable
folder with `messages`, resuming skips prompts already written, and the folder feeds training/retrofit.py."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_model import chat_tokenizer, conversations, save_chat_model
from kvpop_hf.data import load_source
from kvpop_hf.data.traces import META_NAME, generate_traces, main, prompt_messages, sample

datasets = pytest.importorskip("datasets")
from kvpop_hf.cli import retrofit  # noqa: E402  (after the skip)

pytestmark = pytest.mark.tier("scripts")


def _prompts_file(tmp_path, n):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(n, seed=3)))
    return path


def test_traces_end_to_end_resume_and_retrofit(tmp_path):
    model = save_chat_model(tmp_path / "m")
    prompts = _prompts_file(tmp_path, 5)
    out = tmp_path / "traces"
    common = ["--model", str(model), "--prompts", str(prompts), "--output_dir", str(out), "--batch_size", "2",
              "--max_new_tokens", "12", "--no_progress", "--device", "cpu", "--dtype", "float32"]
    assert sample(common + ["--num_prompts", "3"]) == {"written": 3, "skipped": 0}
    assert sample(common) == {"written": 2, "skipped": 3}  # resumed: only the two new prompts sampled
    assert main(common) == 0  # the exit status of the command; nothing new written
    assert sample(common) == {"written": 0, "skipped": 5}
    with pytest.raises(ValueError, match="other settings .*'system_prompt'"):  # another prompt source: refused
        main(common + ["--system_prompt", "Be brief."])
    ds = load_source(str(out))
    assert (out / META_NAME).is_file() and len(ds) == 5 and sorted(ds["prompt_id"]) == list(range(5))
    tok = AutoTokenizer.from_pretrained(model)
    for row in ds:
        src = conversations(5, seed=3)[row["prompt_id"]]
        assert row["messages"][:2] == src[:2]  # the prompt turns; the data's own answer replaced by the model's
        assert row["messages"][2]["role"] == "assistant"
        assert 1 <= row["num_generated_tokens"] <= 12
    # the trace folder is a retrofit dataset
    trainer = retrofit.train(["--model", str(model), "--dataset", str(out), "--messages_field", "messages",
                             "--seq_len", "256", "--sinks", "2", "--window", "8", "--topk", "16", "--scorer", "mlp",
                             "--output_dir", str(tmp_path / "r"), "--per_device_train_batch_size", "2",
                             "--max_steps", "1", "--report_to", "none", "--use_cpu", "True", "--disable_tqdm", "True",
                             "--save_strategy", "no"])
    assert trainer.state.global_step == 1 and len(trainer.train_dataset) == 5
    assert tok.decode(trainer.train_dataset[0]["input_ids"]).startswith("<|im_start|>system")


def test_greedy_batched_traces_equal_one_prompt_at_a_time(tmp_path):
    """Left padding: a prompt's greedy completion does not depend on the batch it is generated in."""
    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(save_chat_model(tmp_path / "m"))
    prompts = [prompt_messages({"messages": c}, "messages", None, None) for c in conversations(3, seed=1)]
    for batch, folder in ((3, "a"), (1, "b")):
        generate_traces(model, tok, prompts, tmp_path / folder, batch_size=batch, max_new_tokens=8, do_sample=False,
                        progress=False)
    rows = [[json.loads(line) for line in (tmp_path / f / "traces.jsonl").read_text().splitlines()] for f in "ab"]
    assert [r["messages"] for r in rows[0]] == [r["messages"] for r in rows[1]]
    assert all(r["num_generated_tokens"] >= 4 and r["messages"][-1]["content"] for r in rows[0])
    assert tok.padding_side == "right"  # the tokenizer's own side is restored


def test_an_interrupted_line_is_generated_again(tmp_path):
    tok = chat_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(save_chat_model(tmp_path / "m"))
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    generate_traces(model, tok, prompts[:2], tmp_path / "t", max_new_tokens=4, progress=False)
    path = tmp_path / "t" / "traces.jsonl"
    path.write_bytes(path.read_bytes()[:-10])  # the second line cut short
    assert generate_traces(model, tok, prompts, tmp_path / "t", max_new_tokens=4, progress=False) == \
        {"written": 2, "skipped": 1}
    assert sorted(json.loads(x)["prompt_id"] for x in path.read_text().splitlines()) == [0, 1, 2]


def test_bad_trace_inputs_fail_before_the_model_loads(tmp_path):
    tok_only = tmp_path / "tok"
    chat_tokenizer().save_pretrained(tok_only)
    prompts = _prompts_file(tmp_path, 2)
    base = ["--model", str(tok_only), "--output_dir", str(tmp_path / "o"), "--no_progress"]
    with pytest.raises(ValueError, match="--prompt_field 'question' is not a column"):
        main(base + ["--prompts", str(prompts), "--prompt_field", "question"])
    no_user = tmp_path / "no_user.jsonl"
    no_user.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="no user turn"):
        main(base + ["--prompts", str(no_user)])
    plain = tmp_path / "plain"
    chat_tokenizer(chat_template=None).save_pretrained(plain)
    with pytest.raises(ValueError, match="chat template"):
        main(["--model", str(plain), "--prompts", str(prompts), "--output_dir", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="set --num_prompts"):
        main(base + ["--prompts", str(prompts), "--streaming"])
    with pytest.raises(ValueError, match="--shard_index"):
        main(base + ["--prompts", str(prompts), "--num_shards", "2", "--shard_index", "2"])
