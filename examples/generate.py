"""Quick start: generate with a fixed-budget KVpopCache and compare with a DynamicCache.

    python examples/generate.py                       # the 4k testbed: the KVpop student against the dense teacher
    python examples/generate.py --prompt-len 4096     # a full-length testbed problem
    python examples/generate.py --scorer knorm        # a heuristic scorer on the teacher instead of the student
    python examples/generate.py --random-model --scorer mlstm --prompt-len 1024   # tiny random-init Qwen3

With the committed checkpoints (``--checkpoint``, default ``checkpoints/testbed-4k-teacher``, the dense model
and its tokenizer; ``--scorer-checkpoint``, default ``checkpoints/testbed-4k-kvpop-cr88``) the prompt is a
``reasoning`` problem of the 4k testbed (10 facts, 4 rules) and the script prints the reference answer and the
answers extracted from both generations: the KVpop run is the student (the teacher with the folder's LoRA
adapter, loaded over ``--checkpoint`` through ``peft``) with its learned cache at B = 492 entries per KV head;
the reference is the teacher with a full ``DynamicCache``. A scorer folder without an adapter runs on the
teacher itself; ``--scorer NAME`` runs a heuristic on the teacher; ``--sinks/--window/--topk`` override the
folder's budget.

With ``--random-model`` (or when ``--checkpoint`` holds no ``config.json`` and tokenizer) the model is a small
random-init Qwen3 fed random token ids: the text is meaningless, but the cache mechanics (fixed budget, memory,
speed, agreement with a full cache) are real.

The model runs with ``attn_implementation="kvpop"``, so every query of the prompt sees exactly its
own fixed-budget set per KV head (the same set it would see when decoding token by token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config
from transformers.generation.streamers import BaseStreamer

from kvpop_hf import SCORERS, KVpopCache, prefill_in_chunks  # importing kvpop_hf registers attn_implementation="kvpop"
from kvpop_hf.cache import kv_tensor_bytes
from kvpop_hf.compat import with_cache

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "testbed-4k-teacher"
DEFAULT_SCORER_CHECKPOINT = REPO / "checkpoints" / "testbed-4k-kvpop-cr88"
PROBLEMS = Path(__file__).resolve().parent / "testbed_problems.json"  # written by kvpop_lab.testbed.example_problems


class TqdmStreamer(BaseStreamer):
    """Advances a tqdm bar once per generated token and records when each token arrived."""

    def __init__(self, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=True, dynamic_ncols=True)
        self.times: list[float] = []
        self._prompt_seen = False
        self.start = time.perf_counter()

    def put(self, value):
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.bar.update(1)

    def end(self):
        self.bar.close()

    def per_token_seconds(self) -> float:
        """Median time between consecutive generated tokens (excludes the prefill + first token)."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return statistics.median(gaps) if gaps else float("nan")

    def first_token_seconds(self) -> float:
        return self.times[0] - self.start if self.times else float("nan")


def has_checkpoint(path: Path) -> bool:
    tok_files = ("tokenizer.json", "tokenizer_config.json")
    return (path / "config.json").is_file() and any((path / f).is_file() for f in tok_files)


def testbed_problem(length: int) -> dict:
    """The shipped testbed problem of ``length`` tokens (``prompt``, ``answer``, ...) from :data:`PROBLEMS`."""
    problems = json.loads(PROBLEMS.read_text())
    if str(length) not in problems:
        raise SystemExit(f"--prompt-len {length}: the shipped testbed problems have {', '.join(problems)} tokens "
                         "(with --random-model any length works).")
    return problems[str(length)]


def final_answer(text: str, eos: str) -> str:
    """The testbed's answer convention: the first line after the last ``answer :`` before the first ``eos``,
    whitespace collapsed."""
    text = text.split(eos, 1)[0].rsplit("answer :", 1)[-1]
    return " ".join(text.strip().split("\n", 1)[0].split())


def pick_scorer_checkpoint(args, trained_model: bool) -> Path | None:
    """The learned scorer folder to load, or None for a scorer by name. An explicit --scorer-checkpoint must
    exist and needs the trained model; the default one is used only with the trained model, when present and
    no --scorer was named."""
    if args.scorer_checkpoint is not None:
        path = Path(args.scorer_checkpoint)
        if args.scorer is not None:
            raise SystemExit("give either --scorer or --scorer-checkpoint, not both")
        if not (path / "kvpop_config.json").is_file():
            raise SystemExit(f"--scorer-checkpoint {path}: no kvpop_config.json there (expected a trained scorer "
                             "folder such as checkpoints/testbed-4k-kvpop-cr88)")
        if not trained_model:
            raise SystemExit("--scorer-checkpoint needs the trained model it was retrofitted on (--checkpoint); "
                             "the random-init model has no trained scorer")
        return path
    if trained_model and args.scorer is None and (DEFAULT_SCORER_CHECKPOINT / "kvpop_config.json").is_file():
        return DEFAULT_SCORER_CHECKPOINT
    return None


def load_student(base: Path, adapter: Path) -> torch.nn.Module:
    """The LoRA student: the adapter folder applied to the base model at ``base`` (given explicitly, so the
    adapter's own relative ``base_model_name_or_path`` need not resolve from the working directory), merged."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="kvpop", dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def tiny_qwen3(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=max(4096, args.prompt_len + args.max_new_tokens + 8),
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="kvpop")
    with torch.no_grad():  # random norm gains -> keys of distinct norms, so "knorm" has something to rank
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
    return model.eval()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run_generate(model, ids, cache, args, desc, eos_token_id, pad_token_id):
    streamer = TqdmStreamer(args.max_new_tokens, desc)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad_token_id,
               eos_token_id=eos_token_id, streamer=streamer, attention_mask=torch.ones_like(ids))
    if eos_token_id is None:
        gen["min_new_tokens"] = args.max_new_tokens
    t0 = time.perf_counter()
    with torch.inference_mode():
        if args.prefill_chunk_size and ids.shape[1] > 1:
            # the prompt in chunks outside generate's compiled call (kvpop_hf/prefill.py); generate continues
            # from the filled cache and keeps its compiled decode steps on CUDA
            prefill_in_chunks(model, cache, ids, args.prefill_chunk_size, attention_mask=gen["attention_mask"])
        out = model.generate(ids, **with_cache(model, cache, **gen))
    wall = time.perf_counter() - t0
    return out[0, ids.shape[1]:], streamer, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scorer", default=None, choices=sorted(SCORERS),
                    help="scorer by name (default: the learned --scorer-checkpoint with a trained model, else knorm)")
    ap.add_argument("--scorer-checkpoint", default=None,
                    help="folder of a trained scorer (kvpop_config.json + kvpop_scorer.safetensors) for the trained "
                         f"model (default: {DEFAULT_SCORER_CHECKPOINT.relative_to(REPO)} when present)")
    ap.add_argument("--sinks", type=int, default=None, help="default: the scorer folder's, else 4")
    ap.add_argument("--window", type=int, default=None, help="default: the scorer folder's, else 64")
    ap.add_argument("--topk", type=int, default=None, help="default: the scorer folder's, else 128")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="prompt tokens of random ids (default 128), or with a checkpoint the length of the shipped "
                         "testbed problem: 1024 (default) or 4096")
    ap.add_argument("--prefill-chunk-size", type=int, default=0, help="feed the prompt in chunks of this many tokens (kvpop_hf.prefill_in_chunks) before generate; 0: one forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                    help="model dir with config.json + tokenizer; used only if it exists")
    ap.add_argument("--random-model", action="store_true", help="ignore --checkpoint even if it exists")
    ap.add_argument("--no-compare", action="store_true", help="skip the DynamicCache reference run")
    g = ap.add_argument_group("random-init model shape (no checkpoint)")
    g.add_argument("--vocab", type=int, default=1024)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=32)
    args = ap.parse_args(argv)

    ckpt = Path(args.checkpoint)
    trained = not args.random_model and has_checkpoint(ckpt)
    scorer_dir = pick_scorer_checkpoint(args, trained_model=trained)  # bad flags fail before any work
    problem = tokenizer = student = None
    if trained:
        from transformers import AutoTokenizer

        problem = testbed_problem(args.prompt_len or 1024)  # before any work

        print(f"model: {ckpt} (checkpoint)")
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="kvpop", dtype=torch.float32).eval()
        if scorer_dir is not None and (scorer_dir / "adapter_config.json").is_file():
            student = load_student(ckpt, scorer_dir)
            print(f"student: {scorer_dir} (LoRA adapter over {ckpt})")
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids = torch.tensor([bos + tokenizer(problem["prompt"], add_special_tokens=False)["input_ids"]])
        eos_token_id = tokenizer.eos_token_id
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_id
    else:
        args.prompt_len = args.prompt_len or 128
        if not args.random_model:
            print(f"({ckpt} has no config.json + tokenizer: using a random-init model)")
        model = tiny_qwen3(args)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: random-init Qwen3, {args.layers} layers, hidden {args.hidden}, {args.heads} q heads / "
              f"{args.kv_heads} KV heads x {args.head_dim}, vocab {args.vocab} ({n_params / 1e6:.1f} M params)")
        g_ids = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(1, args.vocab, (1, args.prompt_len), generator=g_ids)
        eos_token_id, pad_token_id = None, 0

    budget = {k: v for k, v in dict(sinks=args.sinks, window=args.window, topk=args.topk).items() if v is not None}
    if scorer_dir is not None:
        cache = KVpopCache.from_pretrained(scorer_dir, model.config, **budget)
        scorer_name = f"learned {cache.kvpop_config.scorer} from {scorer_dir}"
        args.scorer = cache.kvpop_config.scorer
    else:
        args.scorer = args.scorer or "knorm"
        cache = KVpopCache(model.config, scorer=args.scorer, **{"sinks": 4, "window": 64, "topk": 128, **budget})
        scorer_name = repr(args.scorer)
    args.sinks, args.window, args.topk = cache.kvpop_config.sinks, cache.kvpop_config.window, cache.kvpop_config.topk
    B = cache.budget
    n_prompt = ids.shape[1]
    print(f"budget: B = sinks {args.sinks} + window {args.window} + topk {args.topk} = {B} entries per layer "
          f"and KV head; scorer {scorer_name}")
    print(f"prompt: {n_prompt} tokens; max new tokens: {args.max_new_tokens}; torch threads: "
          f"{torch.get_num_threads()}")

    new_kv, st_kv, wall_kv = run_generate(student or model, ids, cache, args, f"KVpopCache({args.scorer})",
                                          eos_token_id, pad_token_id)
    n_new = len(new_kv)
    seen = int(cache.get_seq_length())
    stored = torch.stack([(cache.stored_positions(i) >= 0).sum(-1) for i in range(len(cache.layers))])
    kv_bytes = cache.memory_bytes()
    kv_only = sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                  for l in cache.layers if l.is_initialized)

    dyn_new = dyn_bytes = st_dyn = wall_dyn = None
    if not args.no_compare:
        dyn = DynamicCache(config=model.config)
        old_attn = model.config._attn_implementation
        model.set_attn_implementation("sdpa")  # the stock path a DynamicCache user would run
        try:
            dyn_new, st_dyn, wall_dyn = run_generate(model, ids, dyn, args, "DynamicCache", eos_token_id,
                                                     pad_token_id)
        finally:
            model.set_attn_implementation(old_attn)
        dyn_bytes = kv_tensor_bytes(dyn)

    # the bytes a DynamicCache holds for this sequence: every seen token, keys + values, all layers / KV heads
    cfg = cache.kvpop_config
    elem = next(l for l in cache.layers if l.is_initialized).keys.element_size()
    dyn_bytes_formula = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * seen * elem

    print()
    print("== KVpopCache ==")
    print(f"tokens generated:            {n_new}")
    print(f"tokens seen per head:        {seen}  (prompt {n_prompt} + generated {n_new} - 1 not yet cached)")
    print(f"entries stored per head:     min {int(stored.min())} / max {int(stored.max())}  (budget {B}; "
          f"{len(cache.layers)} layers x {cfg.num_kv_heads} KV heads)")
    print(f"cache bytes (KVpop):         {fmt_bytes(kv_bytes)} total, of which keys+values {fmt_bytes(kv_only)} "
          f"(the rest: positions, priorities, scorer state)")
    if dyn_bytes is not None:
        print(f"cache bytes (DynamicCache):  {fmt_bytes(dyn_bytes)} measured for the same sequence "
              f"-> KVpop holds {kv_bytes / dyn_bytes:.1%} of it")
    else:
        print(f"cache bytes (DynamicCache):  {fmt_bytes(dyn_bytes_formula)} (computed: 2 x layers x KV heads x "
              f"head_dim x {seen} tokens x {elem} B) -> KVpop holds {kv_bytes / dyn_bytes_formula:.1%} of it")
    print(f"time per token (KVpop):      {1e3 * st_kv.per_token_seconds():.2f} ms median decode step; "
          f"prefill + first token {1e3 * st_kv.first_token_seconds():.0f} ms; total {wall_kv:.2f} s")
    if dyn_new is not None:
        print(f"time per token (Dynamic):    {1e3 * st_dyn.per_token_seconds():.2f} ms median decode step; "
              f"prefill + first token {1e3 * st_dyn.first_token_seconds():.0f} ms; total {wall_dyn:.2f} s")
        n = min(len(new_kv), len(dyn_new))
        same = (new_kv[:n] == dyn_new[:n])
        agree = same.float().mean().item() if n else float("nan")
        diff = (~same).nonzero()
        first = int(diff[0]) if len(diff) else None
        exact_until = max(0, min(n, B - n_prompt + 1))  # new tokens predicted while the context fits in B
        print(f"greedy agreement with DynamicCache: {agree:.1%} of {n} tokens; first divergence at new token "
              f"{first if first is not None else '-'}"
              + ("" if first is None else f" (context {n_prompt + first} tokens)")
              + f"; the context exceeds the budget from new token {exact_until} on "
              f"(before that both caches hold every token, up to float noise)")
        if exact_until > 0:
            pre = same[:exact_until].float().mean().item()
            print(f"  agreement while context <= budget: {pre:.1%} of {min(exact_until, n)} tokens")
    if problem is not None:
        print()
        print(f"problem answer:            {problem['answer']}")
        runs = [("KVpop", new_kv)] + ([("Dynamic", dyn_new)] if dyn_new is not None else [])
        for name, toks in runs:
            text = tokenizer.decode(toks, skip_special_tokens=False)
            ans = final_answer(text, tokenizer.eos_token)
            snippet = text if len(text) <= 160 else text[:80] + " ... " + text[-75:]
            print(f"generated ({name}): {snippet!r}")
            print(f"  extracted answer: {ans!r} -> {'correct' if ans == problem['answer'] else 'wrong'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
