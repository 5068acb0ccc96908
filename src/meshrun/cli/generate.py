"""`meshrun generate`: sample a completion from a trained or exported model (torch and
transformers imported only once the command runs)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping

from ..errors import bad_value, require_packages
from ..paths import check_path_text
from .options import add_option, int_option

GENERATE_PACKAGES = ("torch", "transformers")
MAX_NEW_TOKENS = 1 << 20


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("generate", help="sample a completion from a run, a snapshot, an exported model or adapter",
                       description="Load a model and print the completion of --prompt (the prompt itself is not "
                                   "printed), sampled with\ntransformers' generate on the GPU if there is one. "
                                   "SOURCE is one of:\n"
                                   "  a Hugging Face model directory (config.json; meshrun export's output)\n"
                                   "  an adapter directory in PEFT's format (adapter_config.json): on the base "
                                   "model it names\n"
                                   "  a run's directory (OUT), its checkpoints, or one snapshot: the newest "
                                   "snapshot's model, or a\n  LoRA run's adapter on its base model (which must "
                                   "still be where the run read it, unchanged)\n"
                                   "The tokenizer is the model's (its directory, the base model's, the run's "
                                   "--model), or --tokenizer DIR.\nA run of meshrun's own GPT (no --model) has no "
                                   "tokenizer to sample with: it is refused.\n\n"
                                   "examples:\n"
                                   "  meshrun generate runs/llama --prompt 'def fib(n):' --max-new-tokens 64   "
                                   "# a run of --model DIR\n"
                                   "  meshrun generate exported/ --prompt 'Hello' --temperature 0   # greedy: "
                                   "the same text every time\n"
                                   "  meshrun generate adapter/ --prompt 'What is NCCL?' --chat      # one user "
                                   "turn of the chat template",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("source", metavar="SOURCE", help="a model or adapter directory, a run directory or a snapshot")
    add_option(g, "--prompt", required=True, metavar="TEXT", from_env=False, help="the text to complete")
    add_option(g, "--max-new-tokens", metavar="N", default="64", from_env=False,
               help="tokens to generate at most (default 64; fewer when the model ends its text)")
    add_option(g, "--temperature", metavar="T", default="1.0", from_env=False,
               help="sampling temperature (default 1.0); 0: greedy, the likeliest token each time")
    add_option(g, "--seed", metavar="S", default="0", from_env=False,
               help="the sampler's seed (default 0): the same seed, the same text")
    add_option(g, "--chat", action="store_true", from_env=False,
               help="wrap the prompt as one user turn with the tokenizer's chat template")
    add_option(g, "--tokenizer", metavar="DIR", from_env=False,
               help="read the tokenizer from DIR (default: the model's own)")
    g.set_defaults(func=cmd_generate)


def cmd_generate(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    check_path_text(ns.source, "SOURCE")
    if ns.tokenizer is not None:
        check_path_text(ns.tokenizer, "--tokenizer")
        if not os.path.isdir(ns.tokenizer):
            raise bad_value("--tokenizer", ns.tokenizer, "not a directory", "give a directory that holds "
                            "tokenizer.json or tokenizer_config.json")
    if not ns.prompt:
        raise bad_value("--prompt", ns.prompt, "is empty", "give the text to complete")
    max_new = int_option(ns, "max_new_tokens", 1, (MAX_NEW_TOKENS, "a completion that long is no sample"))
    seed = int_option(ns, "seed", 0)
    temperature = _temperature(ns.temperature)
    if not os.path.exists(ns.source):
        raise bad_value("SOURCE", ns.source, "no such file or directory", "give a model directory, an adapter "
                        "directory, a run's directory or one of its snapshots")
    require_packages("generate", GENERATE_PACKAGES, "hf")
    from ..training import generate

    loaded = generate.load(ns.source, ns.tokenizer)
    print(generate.sample(loaded.model, loaded.tokenizer, ns.prompt, int(max_new or 1), temperature, int(seed or 0),
                          ns.chat))
    return 0


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise bad_value("--temperature", text, "is not a number", "0 for greedy, or a positive number such as 0.7") \
            from None
    if not math.isfinite(value) or value < 0:
        raise bad_value("--temperature", text, "must be a finite number >= 0", "0 for greedy, or 0.7")
    return value
