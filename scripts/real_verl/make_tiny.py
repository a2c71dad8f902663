"""Build a tiny random-init Qwen2 model + byte-level BPE tokenizer + toy parquet data, fully offline.

usage: python make_tiny.py [OUT_DIR]   (default /tmp/vs-tiny, where studies/tiny-h200.yaml looks)
writes OUT_DIR/model (config.json, model.safetensors, tokenizer files, generation_config.json)
       OUT_DIR/data/train.parquet, OUT_DIR/data/val.parquet
       OUT_DIR/reward_sevens.py
"""
import json, os, random, sys

import pandas as pd
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/vs-tiny"
mdir, ddir = os.path.join(out, "model"), os.path.join(out, "data")
os.makedirs(mdir, exist_ok=True); os.makedirs(ddir, exist_ok=True)
rng = random.Random(0)

# ---------- tokenizer: byte-level BPE (GPT-2/Qwen style), ~300 tokens ----------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
words = ["say", "write", "print", "seven", "sevens", "number", "digit", "please", "many", "the", "a", "of", "user", "assistant", "system"]
def rand_line():
    parts = [rng.choice(words) for _ in range(rng.randint(2, 6))]
    parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 8))))
    rng.shuffle(parts)
    return " ".join(parts)
corpus = [rand_line() for _ in range(5000)]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(corpus, trainer=trainer)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
hf_tok = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    additional_special_tokens=["<|im_start|>"],
    model_max_length=4096,
    padding_side="left",
)
hf_tok.chat_template = CHAT_TEMPLATE
hf_tok.save_pretrained(mdir)
V = len(hf_tok)
print("vocab", V, "eos", hf_tok.eos_token_id, "pad", hf_tok.pad_token_id)

# ---------- model: tiny Qwen2, random init ----------
cfg = Qwen2Config(
    vocab_size=V, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,  # head_dim 64: fine for FA3/sdpa
    max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
    bos_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
)
cfg.architectures = ["Qwen2ForCausalLM"]
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
model.config.torch_dtype = "bfloat16"  # transformers 5 also writes "dtype"
model.save_pretrained(mdir, safe_serialization=True)
GenerationConfig(eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, bos_token_id=hf_tok.pad_token_id).save_pretrained(mdir)
print("params", sum(p.numel() for p in model.parameters()))

# ---------- data ----------
def rows(n, split):
    r = []
    for i in range(n):
        q = f"{rng.choice(['say', 'write', 'print'])} {rng.choice(['seven', 'sevens', 'many sevens'])} {rng.randint(0, 999)}"
        r.append({
            "data_source": "toy_sevens",
            "prompt": [{"role": "user", "content": q}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": "7"},
            "extra_info": {"split": split, "index": i},
        })
    return pd.DataFrame(r)
rows(2048, "train").to_parquet(os.path.join(ddir, "train.parquet"))
rows(64, "test").to_parquet(os.path.join(ddir, "val.parquet"))

with open(os.path.join(out, "reward_sevens.py"), "w") as f:
    f.write('''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Toy reward: fraction of response characters that are the digit 7 (0 for an empty response)."""
    s = solution_str or ""
    return s.count("7") / max(len(s), 1)
''')
print("wrote", out)
