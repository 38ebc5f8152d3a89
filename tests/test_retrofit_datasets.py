"""training/retrofit.py and KVpopTrainer on Hugging Face `datasets` data (CPU, offline): a local dataset folder of
`messages` conversations rendered by a real chat template, data files, streaming, and every bad input stopped
before the model loads."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_model import CHATML, chat_tokenizer, conversations, save_chat_model
from kvpop_hf import KVpopCache
from kvpop_hf.compat import with_cache
from kvpop_hf.data import KVpopDataArguments, conversation_ids, load_source, prepare_dataset
from kvpop_hf.trainer import KVpopTrainer, KVpopTrainingArguments

datasets = pytest.importorskip("datasets")
from kvpop_hf.cli import retrofit  # noqa: E402  (after the skip)

pytestmark = pytest.mark.tier("scripts")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def tokenizer_only(tmp_path_factory):
    """A folder with the tokenizer and no model weights: a run that got as far as loading the model fails there."""
    folder = tmp_path_factory.mktemp("tok_only")
    chat_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def convo_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("convos") / "ds"
    datasets.Dataset.from_dict({"messages": conversations(6), "id": list(range(6))}).save_to_disk(str(folder))
    return folder


def _argv(model, data, out, *extra):
    return ["--model", str(model), "--dataset", str(data), "--seq_len", "320", "--sinks", "2", "--window", "8",
            "--topk", "16", "--scorer", "mlstm", "--scorer_kwargs", '{"state_dim": 8}', "--output_dir", str(out),
            "--per_device_train_batch_size", "2", "--max_steps", "2", "--learning_rate", "1e-3",
            "--logging_steps", "1", "--report_to", "none", "--use_cpu", "True", "--disable_tqdm", "True",
            "--save_strategy", "no", "--seed", "0", *extra]


def test_retrofit_from_a_local_folder_of_conversations_loads_and_generates(chat_model, convo_folder, tmp_path):
    out = tmp_path / "out"
    trainer = retrofit.train(_argv(chat_model, convo_folder, out, "--messages_field", "messages"))
    assert trainer.state.global_step == 2
    tok = AutoTokenizer.from_pretrained(chat_model)
    rows = trainer.train_dataset
    assert len(rows) == 6 and set(rows.column_names) == {"input_ids", "labels"}
    first = tok.apply_chat_template(conversations(6)[0], tokenize=False)
    assert tok.decode(rows[0]["input_ids"]) == first  # the chat template's rendering, one conversation per row
    assert len({len(r) for r in rows["input_ids"]}) > 1  # different lengths: padded batches trained
    lm = AutoModelForCausalLM.from_pretrained(out)
    cache = KVpopCache.from_pretrained(out, lm.config)
    lm.set_attn_implementation("kvpop")
    prompt = tok.apply_chat_template(conversations(1, seed=5)[0][:2], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    gen = lm.generate(ids, **with_cache(lm, cache), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]


def test_a_datasets_split_handed_to_the_trainer_is_prepared_as_the_cli_prepares_it(chat_model, convo_folder,
                                                                                    tmp_path):
    tok = AutoTokenizer.from_pretrained(chat_model)
    raw = datasets.load_from_disk(str(convo_folder))
    data_args = KVpopDataArguments(seq_len=320, assistant_only_loss=True)
    cli = prepare_dataset(load_source(str(convo_folder)), tok, data_args)  # what retrofit.build_data returns
    args = KVpopTrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=1,
                                  report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", sinks=2,
                                  window=8, topk=16, scorer="mlp")
    trainer = KVpopTrainer(model=AutoModelForCausalLM.from_pretrained(chat_model), args=args, train_dataset=raw,
                           processing_class=tok, data_args=data_args)
    assert trainer.train_dataset["input_ids"] == cli["input_ids"]
    assert trainer.train_dataset["labels"] == cli["labels"]
    trainer.train()
    assert trainer.state.global_step == 1
    with pytest.raises(ValueError, match="pass processing_class=tokenizer"):
        KVpopTrainer(model=AutoModelForCausalLM.from_pretrained(chat_model), args=args, train_dataset=raw)


def test_assistant_only_labels_cover_exactly_the_assistant_turns():
    tok = chat_tokenizer()
    convo = conversations(1)[0]
    ids, labels = conversation_ids(tok, convo, assistant_only=True)
    supervised = tok.decode([t for t, y in zip(ids, labels) if y != -100])
    assert supervised == convo[2]["content"] + "<|im_end|>\n"
    ids2, labels2 = conversation_ids(tok, convo)
    assert ids2 == ids and labels2 == ids  # default: the whole conversation
    two_turns = convo + [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]
    ids3, labels3 = conversation_ids(tok, two_turns, assistant_only=True)
    assert tok.decode([t for t, y in zip(ids3, labels3) if y != -100]) == \
        convo[2]["content"] + "<|im_end|>\nBecause.<|im_end|>\n"


def test_assistant_only_refuses_a_template_that_rewrites_earlier_turns():
    """A template that drops earlier assistant turns' reasoning (as Qwen3's does) cannot locate them by prefixes."""
    rewrites = CHATML.replace("{{ m['content'] }}", "{{ m['content'] if loop.last or m['role'] != 'assistant' "
                                                    "else m['content'].split('</think>')[-1] }}")
    tok = chat_tokenizer(rewrites)
    convo = conversations(1)[0] + [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "So."}]
    with pytest.raises(ValueError, match="renders the conversation before an assistant turn differently"):
        conversation_ids(tok, convo, assistant_only=True)
    assert conversation_ids(tok, convo)[1]  # the whole conversation (the default) renders fine
    with pytest.raises(ValueError, match="no assistant turn"):
        conversation_ids(tok, convo[:2], assistant_only=True)


def test_data_files_and_folders_of_files_load(tmp_path):
    tok = chat_tokenizer()
    texts = ["one two three", "four five", "six"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_dict({"body": texts}).to_csv(str(tmp_path / "d.csv"), index=False)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    args = KVpopDataArguments(text_field="body", seq_len=64)
    expect = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    for src in ("d.jsonl", "d.parquet", "d.csv", "files"):
        rows = prepare_dataset(load_source(str(tmp_path / src)), tok, args)
        assert rows["input_ids"] == expect, src
    two = prepare_dataset(load_source(str(tmp_path / "d.jsonl")), tok,
                          KVpopDataArguments(text_field="body", seq_len=64, preprocessing_num_workers=2))
    assert two["input_ids"] == expect
    streamed = prepare_dataset(load_source(str(tmp_path / "d.jsonl"), streaming=True), tok, args)
    assert [r["input_ids"] for r in streamed] == expect
    short = prepare_dataset(load_source(str(tmp_path / "d.jsonl")), tok,
                            KVpopDataArguments(text_field="body", seq_len=64, min_length=5, max_length=10))
    assert short["input_ids"] == expect[1:2]  # 14 tokens: above max_length; 4 tokens: below min_length
    cut = prepare_dataset(load_source(str(tmp_path / "d.jsonl")), tok,
                          KVpopDataArguments(text_field="body", seq_len=6, truncation=True))
    assert cut["input_ids"] == [e[:6] for e in expect]


def test_streaming_retrofit(chat_model, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(4)))
    trainer = retrofit.train(_argv(chat_model, data, tmp_path / "o", "--streaming", "True"))
    assert trainer.state.global_step == 2
    with pytest.raises(ValueError, match="--streaming .* set --max_steps"):
        retrofit.main(_argv(chat_model, data, tmp_path / "o", "--streaming", "True", "--max_steps", "-1",
                            "--num_train_epochs", "1"))


def _bad(tokenizer_only, data, tmp_path, *extra):
    return retrofit.main(_argv(tokenizer_only, data, tmp_path / "never", *extra))


def test_bad_inputs_fail_before_the_model_loads(tokenizer_only, convo_folder, tmp_path):
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"text": "a b c " * 100}) + "\n" + json.dumps({"text": "short"}) + "\n")
    with pytest.raises(ValueError, match="--messages_field 'conversation' is not a column .*'messages'"):
        _bad(tokenizer_only, convo_folder, tmp_path, "--messages_field", "conversation")
    with pytest.raises(ValueError, match="neither a 'messages' nor a 'text' column"):
        prepare_dataset(datasets.Dataset.from_dict({"body": ["x"]}), chat_tokenizer(), KVpopDataArguments())
    with pytest.raises(ValueError, match="1 row.* longer than --seq_len 320 .*--truncation"):
        _bad(tokenizer_only, texts, tmp_path)
    with pytest.raises(ValueError, match="no row passes the length filter"):
        _bad(tokenizer_only, texts, tmp_path, "--min_length", "1000")
    with pytest.raises(ValueError, match="empty"):
        prepare_dataset(datasets.Dataset.from_dict({"text": []}), chat_tokenizer(), KVpopDataArguments())
    empty_dir = tmp_path / "empty_ds"
    datasets.Dataset.from_dict({"messages": []}).save_to_disk(str(empty_dir))
    with pytest.raises(ValueError, match="split is empty"):
        _bad(tokenizer_only, empty_dir, tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="split is empty"):
        _bad(tokenizer_only, empty, tmp_path)
    with pytest.raises(ValueError, match="not an existing file or folder"):
        _bad(tokenizer_only, tmp_path / "typo.jsonl", tmp_path)
    with pytest.raises(ValueError, match="--split 'test' is not in"):
        dd = tmp_path / "dd"
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(dd))
        _bad(tokenizer_only, dd, tmp_path, "--split", "test")
    with pytest.raises(ValueError, match="drop --dataset_config"):
        _bad(tokenizer_only, texts, tmp_path, "--dataset_config", "main")
    with pytest.raises(ValueError, match="drop --dataset_config"):
        _bad(tokenizer_only, convo_folder, tmp_path, "--dataset_config", "main")
    with pytest.raises(ValueError, match="not both"):
        _bad(tokenizer_only, texts, tmp_path, "--text_field", "text", "--messages_field", "messages")
    # a tokenizer without a chat template, asked for conversations
    plain = tmp_path / "plain_tok"
    chat_tokenizer(chat_template=None).save_pretrained(plain)
    with pytest.raises(ValueError, match="has none: .*chat template"):
        _bad(plain, convo_folder, tmp_path)
    # the same checks pass where the model would load: the run reaches the (absent) weights
    with pytest.raises((OSError, ValueError), match="config.json"):  # the model folder has no model
        _bad(tokenizer_only, convo_folder, tmp_path)
