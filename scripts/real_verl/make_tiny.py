"""Build a random-init Qwen2 model + byte-level BPE tokenizer + parquet data + reward, offline
and deterministically (same files from the same arguments, on any machine).

usage: python make_tiny.py [OUT_DIR] [--shape tiny|qwen2.5-0.5b]
  tiny           3.2M parameters, 32-token prompts: the toy of studies/tiny-h200.yaml
                 (default OUT_DIR /tmp/vs-tiny)
  qwen2.5-0.5b   Qwen2.5-0.5B's shape (24 layers, hidden 896, intermediate 4864, 14 heads,
                 2 KV heads, head_dim 64; 358M parameters with this 320-token vocabulary) and
                 prompts of random words 20-207 tokens long: the workload of
                 studies/h200-0.5b-throughput.yaml (default OUT_DIR /tmp/vs-0.5b)
writes OUT_DIR/model (config.json, model.safetensors, tokenizer files, generation_config.json)
       OUT_DIR/data/train.parquet, OUT_DIR/data/val.parquet
       OUT_DIR/reward_sevens.py
"""
import argparse
import os
import random

import pandas as pd
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=2048),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=4096),
}
DEFAULT_OUT = {"tiny": "/tmp/vs-tiny", "qwen2.5-0.5b": "/tmp/vs-0.5b"}
#: prompt lengths in tokens of the qwen2.5-0.5b workload (chat template included)
PROMPT_TOKENS = (20, 207)
WORDS = ["say", "write", "print", "seven", "sevens", "number", "digit", "please", "many", "the", "a", "of",
         "user", "assistant", "system"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: the chat template's rendering of one user message, with the generation prompt
CHAT_FRAME = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Toy reward: fraction of response characters that are the digit 7 (0 for an empty response)."""
    s = solution_str or ""
    return s.count("7") / max(len(s), 1)
'''


def build_tokenizer(rng: random.Random, mdir: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2/Qwen style) of ~320 tokens trained on random word lines."""
    def rand_line() -> str:
        parts = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8))))
        rng.shuffle(parts)
        return " ".join(parts)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([rand_line() for _ in range(5000)], trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     additional_special_tokens=["<|im_start|>"], model_max_length=4096,
                                     padding_side="left")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(mdir)
    return hf_tok


def build_model(shape: str, hf_tok: PreTrainedTokenizerFast, mdir: str) -> int:
    cfg = Qwen2Config(vocab_size=len(hf_tok), rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id,
                      pad_token_id=hf_tok.pad_token_id, **SHAPES[shape])
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"  # transformers 5 also writes "dtype"
    model.save_pretrained(mdir, safe_serialization=True)
    GenerationConfig(eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
                     bos_token_id=hf_tok.pad_token_id).save_pretrained(mdir)
    return sum(p.numel() for p in model.parameters())


def tiny_prompt(rng: random.Random, hf_tok: PreTrainedTokenizerFast) -> str:
    return f"{rng.choice(['say', 'write', 'print'])} {rng.choice(['seven', 'sevens', 'many sevens'])} {rng.randint(0, 999)}"


def long_prompt(rng: random.Random, hf_tok: PreTrainedTokenizerFast) -> str:
    """Random words whose chat-formatted prompt is a uniformly drawn 20-207 tokens long."""
    target = rng.randint(*PROMPT_TOKENS)
    words: list[str] = []
    while len(hf_tok(CHAT_FRAME.format(" ".join(words)))["input_ids"]) < target:
        words.append(rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(0, 9999)))
    return " ".join(words)


def write_data(shape: str, rng: random.Random, hf_tok: PreTrainedTokenizerFast, ddir: str) -> None:
    prompt = long_prompt if shape != "tiny" else tiny_prompt

    def rows(n: int, split: str) -> pd.DataFrame:
        return pd.DataFrame([{
            "data_source": "toy_sevens",
            "prompt": [{"role": "user", "content": prompt(rng, hf_tok)}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": "7"},
            "extra_info": {"split": split, "index": i},
        } for i in range(n)])

    rows(2048, "train").to_parquet(os.path.join(ddir, "train.parquet"))
    rows(64, "test").to_parquet(os.path.join(ddir, "val.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args()
    out = args.out or DEFAULT_OUT[args.shape]
    mdir, ddir = os.path.join(out, "model"), os.path.join(out, "data")
    os.makedirs(mdir, exist_ok=True)
    os.makedirs(ddir, exist_ok=True)
    rng = random.Random(0)
    hf_tok = build_tokenizer(rng, mdir)
    print("vocab", len(hf_tok), "eos", hf_tok.eos_token_id, "pad", hf_tok.pad_token_id)
    print("params", build_model(args.shape, hf_tok, mdir))
    write_data(args.shape, rng, hf_tok, ddir)
    with open(os.path.join(out, "reward_sevens.py"), "w") as f:
        f.write(REWARD)
    print("wrote", out)


if __name__ == "__main__":
    main()
