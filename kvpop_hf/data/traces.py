"""Traces from the model itself: sample the dense model's own completions for a set of prompts and write them as a
``datasets``-loadable folder of JSON lines with a ``messages`` field (the prompt turns + the generated assistant
turn), ready for ``training/retrofit.py --dataset FOLDER --messages_field messages``.

Batched ``generate`` with left padding, a progress bar, and resumable: prompts whose ``prompt_id`` is already in the
folder are skipped, so an interrupted run continues where it stopped (a line cut short by the interruption is
dropped and its prompt generated again). Run metadata goes to a hidden ``.kvpop_traces.json`` that ``datasets``
does not read.

Command line: ``kvpop-traces`` or ``python training/generate_traces.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .render import check_chat_template

META_NAME = ".kvpop_traces.json"


def prompt_messages(row, messages_field: str | None, prompt_field: str | None, system_prompt: str | None):
    """The prompt turns of one row: ``messages_field``'s conversation up to its last user turn (any answer after it
    dropped), or ``prompt_field``'s text as one user turn; ``system_prompt`` prepended when the turns have none."""
    if messages_field:
        msgs = row[messages_field]
        users = [i for i, m in enumerate(msgs or []) if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError(f"a row of --messages_field {messages_field!r} has no user turn to answer: "
                             f"{str(msgs)[:200]!r}.")
        msgs = [{"role": m["role"], "content": m["content"]} for m in msgs[:users[-1] + 1]]
    else:
        text = row[prompt_field]
        if not isinstance(text, str) or not text:
            raise ValueError(f"--prompt_field {prompt_field!r} must hold non-empty strings, got {text!r}.")
        msgs = [{"role": "user", "content": text}]
    if system_prompt and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def trace_files(out_dir: Path):
    return sorted(p for p in Path(out_dir).glob("*.jsonl") if p.is_file())


def done_prompt_ids(out_dir: Path) -> set:
    """``prompt_id`` of every complete line already written in ``out_dir``; a last line cut short by an
    interruption is removed from its file."""
    done = set()
    for path in trace_files(out_dir):
        raw = path.read_bytes()
        keep = raw if raw.endswith(b"\n") or not raw else raw[:raw.rfind(b"\n") + 1]
        if keep != raw:
            path.write_bytes(keep)
        for line in keep.decode("utf-8").splitlines():
            if line.strip():
                done.add(json.loads(line)["prompt_id"])
    return done


def _as_list(ids) -> list:
    return [] if ids is None else list(ids) if isinstance(ids, (list, tuple)) else [ids]


def generate_traces(model, tokenizer, prompts, out_dir, prompt_ids=None, batch_size: int = 8,
                    max_new_tokens: int = 16384, do_sample: bool = True, temperature: float = 0.6,
                    top_p: float = 0.95, top_k: int | None = 20, seed: int = 0, template_kwargs: dict | None = None,
                    file_name: str = "traces.jsonl", progress: bool = True) -> dict:
    """Sample one completion per prompt and append ``{"prompt_id", "messages", "num_generated_tokens",
    "finished"}`` lines to ``out_dir/file_name``.

    ``prompts``: a list of conversations (``[{"role", "content"}, ...]`` ending with the user turn to answer);
    ``prompt_ids``: their ids (default: their indices), prompts whose id is already in ``out_dir`` are skipped;
    ``finished``: the completion ended with the EOS token (else it stopped at ``max_new_tokens``).
    Returns ``{"written": n, "skipped": m}``."""
    import torch
    from tqdm.auto import tqdm

    check_chat_template(tokenizer)
    prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
    if len(prompt_ids) != len(prompts) or len(set(prompt_ids)) != len(prompt_ids):
        raise ValueError("prompt_ids must be unique, one per prompt.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = done_prompt_ids(out_dir)
    todo = [(i, p) for i, p in zip(prompt_ids, prompts) if i not in done]
    kw = dict(template_kwargs or {})
    pad_side, pad_id = tokenizer.padding_side, tokenizer.pad_token_id
    tokenizer.padding_side = "left"  # generate continues every row from its last real token
    if pad_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos_ids = set(_as_list(tokenizer.eos_token_id)) | set(
        _as_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))
    gen = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=tokenizer.pad_token_id)
    if do_sample:
        gen.update(temperature=temperature, top_p=top_p, top_k=top_k)
    device = next(model.parameters()).device
    model.eval()
    written = 0
    try:
        with open(out_dir / file_name, "a", encoding="utf-8") as fh, \
                tqdm(total=len(todo), unit="prompt", desc="traces", disable=not progress) as bar:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start:start + batch_size]
                texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **kw)
                         for _, p in chunk]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                torch.manual_seed(seed + start)
                with torch.no_grad():
                    out = model.generate(**enc, **gen)
                new = out[:, enc["input_ids"].shape[1]:].tolist()
                for (pid, prompt), toks in zip(chunk, new):
                    stop = next((j for j, t in enumerate(toks) if t in eos_ids), None)
                    toks = toks if stop is None else toks[:stop]
                    text = tokenizer.decode(toks, skip_special_tokens=True)
                    rec = {"prompt_id": pid, "messages": prompt + [{"role": "assistant", "content": text}],
                           "num_generated_tokens": len(toks) + (stop is not None), "finished": stop is not None}
                    fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                fh.flush()
                written += len(chunk)
                bar.update(len(chunk))
    finally:
        tokenizer.padding_side = pad_side
        if pad_id is None:
            tokenizer.pad_token = None
    return {"written": written, "skipped": len(prompts) - len(todo)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop-traces", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="Dense model directory or Hub id (AutoModelForCausalLM).")
    p.add_argument("--prompts", required=True, help="Prompt source: Hub dataset name, local dataset folder or data "
                   "file (.jsonl .json .parquet .arrow .csv), read with datasets.")
    p.add_argument("--dataset_config", default=None, help="Hub dataset configuration.")
    p.add_argument("--split", default="train")
    p.add_argument("--streaming", action="store_true", help="Stream the source (read only the prompts used).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--messages_field", default=None, help="Column of conversations: each is cut after its last "
                     "user turn. Neither field: 'messages' if present, else 'prompt'.")
    src.add_argument("--prompt_field", default=None, help="Column of prompt strings (one user turn each).")
    p.add_argument("--system_prompt", default=None, help="System turn prepended to prompts that have none.")
    p.add_argument("--chat_template_kwargs", default="{}", help="JSON dict for apply_chat_template, e.g. "
                   "'{\"enable_thinking\": true}'.")
    p.add_argument("--num_prompts", type=int, default=None, help="Use the first N prompts of the split.")
    p.add_argument("--output_dir", required=True, help="Trace folder (created; an existing one is resumed).")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=16384)
    p.add_argument("--greedy", action="store_true", help="Greedy decoding instead of sampling.")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--top_k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="Device (default: cuda if available, else cpu).")
    p.add_argument("--num_shards", type=int, default=1, help="Split the prompts over N processes (one per GPU)...")
    p.add_argument("--shard_index", type=int, default=0, help="...this process takes prompts i with i %% N == index.")
    p.add_argument("--no_progress", action="store_true", help="No progress bar.")
    return p


def load_prompts(args):
    """(prompt conversations, their ids) from ``args``' source; every check before the model loads."""
    from .sources import load_source

    data = load_source(args.prompts, args.dataset_config, args.split, args.streaming)
    if args.num_prompts is not None:
        data = data.take(args.num_prompts) if args.streaming else data.select(range(min(args.num_prompts, len(data))))
    rows = list(data)
    if not rows:
        raise ValueError(f"the prompt split is empty: check --prompts {args.prompts!r} / --split {args.split!r}.")
    columns = list(rows[0])
    messages_field, prompt_field = args.messages_field, args.prompt_field
    if not messages_field and not prompt_field:
        if "messages" in columns:
            messages_field = "messages"
        elif "prompt" in columns:
            prompt_field = "prompt"
        else:
            raise ValueError(f"the prompt split has neither a 'messages' nor a 'prompt' column (columns: {columns}): "
                             "name one with --messages_field or --prompt_field.")
    field = messages_field or prompt_field
    if field not in columns:
        flag = "--messages_field" if messages_field else "--prompt_field"
        raise ValueError(f"{flag} {field!r} is not a column of the prompts; their columns are {columns}.")
    ids = [i for i in range(len(rows)) if i % args.num_shards == args.shard_index]
    prompts = [prompt_messages(rows[i], messages_field, prompt_field, args.system_prompt) for i in ids]
    return prompts, ids


# what a prompt_id means: resuming into a folder written from another source would skip the wrong prompts
SOURCE_KEYS = ("model", "prompts", "dataset_config", "split", "messages_field", "prompt_field", "system_prompt",
               "chat_template_kwargs")


def check_same_source(out_dir: Path, args) -> None:
    """A ValueError when ``out_dir`` holds traces of another model or prompt source than ``args``."""
    meta_path = out_dir / META_NAME
    if not meta_path.is_file():
        return
    old = json.loads(meta_path.read_text())
    diff = {k: (old.get(k), getattr(args, k)) for k in SOURCE_KEYS if old.get(k) != getattr(args, k)}
    if diff and trace_files(out_dir):
        raise ValueError(f"--output_dir {str(out_dir)!r} holds traces written with other settings "
                         f"{ {k: v[0] for k, v in diff.items()} } (now { {k: v[1] for k, v in diff.items()} }): "
                         "resuming would skip the wrong prompts; use a new --output_dir.")


def sample(argv=None) -> dict:
    """Parses `argv`, samples the traces not yet written; returns ``{"written": n, "skipped": m}``."""
    args = build_parser().parse_args(argv)
    if not 0 <= args.shard_index < args.num_shards:
        raise ValueError(f"--shard_index must be in [0, --num_shards={args.num_shards}), got {args.shard_index}.")
    if args.streaming and args.num_prompts is None:
        raise ValueError("--streaming reads prompts from a stream: set --num_prompts (how many to take).")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError("--batch_size and --max_new_tokens must be >= 1.")
    try:
        template_kwargs = json.loads(args.chat_template_kwargs)
        assert isinstance(template_kwargs, dict)
    except (json.JSONDecodeError, AssertionError):
        raise ValueError(f"--chat_template_kwargs must be a JSON object, got {args.chat_template_kwargs!r}.") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_same_source(Path(args.output_dir), args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    check_chat_template(tokenizer)
    prompts, ids = load_prompts(args)  # prompt errors before the model loads
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("no_progress",)}
    (out / META_NAME).write_text(json.dumps(meta, indent=1))
    name = "traces.jsonl" if args.num_shards == 1 else f"traces-{args.shard_index:05d}-of-{args.num_shards:05d}.jsonl"
    result = generate_traces(model, tokenizer, prompts, out, prompt_ids=ids, batch_size=args.batch_size,
                             max_new_tokens=args.max_new_tokens, do_sample=not args.greedy,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                             template_kwargs=template_kwargs, file_name=name, progress=not args.no_progress)
    print(f"{result['written']} traces written, {result['skipped']} prompts already done -> {out}", file=sys.stderr)
    return result


def main(argv=None) -> int:
    """The ``kvpop-traces`` command (``training/generate_traces.py``): :func:`sample`; 0 (the exit status)."""
    sample(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
