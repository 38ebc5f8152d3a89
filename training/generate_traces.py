"""Sample the dense model's own long completions for a set of prompts, as a trace folder for retrofit.py.

Example (one GPU; resumable, rerun the same command after an interruption)::

    python training/generate_traces.py --model Qwen/Qwen3-8B --prompts nvidia/Nemotron-Math-v2 \\
        --split high_part00 --streaming --num_prompts 4000 --messages_field messages \\
        --max_new_tokens 16000 --batch_size 32 --output_dir traces/qwen3-8b

The same command is installed as ``kvpop-traces``; the logic lives in kvpop_hf/data/traces.py (``--help``).
"""

from kvpop_hf.data.traces import main

if __name__ == "__main__":
    raise SystemExit(main())
