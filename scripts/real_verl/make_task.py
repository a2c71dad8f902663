"""A task a small model learns by RL, built offline and deterministically: 3-digit addition.

A random-init Qwen2 (default 8 layers, hidden 384; 17.7M parameters with a 24-token character
vocabulary) is first taught in plain PyTorch, imperfectly: supervised mostly on sums whose
columns never carry (``--sft-carry-share`` of them carry), it learns the format and the
digit-wise sums, and carrying only in part. GRPO with an exact-match reward on prompts that
mostly carry then has a curve to climb where the update's size and direction matter: a
too-large lr unlearns the format, KL and the mini-batch set the pace. The sizes and shares
are a first guess, to be set from the reward curves measured on the device.

usage: python make_task.py OUT_DIR [--device cuda] [--sft-steps 600] [--layers 8] [--hidden 384]
writes OUT_DIR/model (config.json, model.safetensors, tokenizer files, generation_config.json)
       OUT_DIR/data/train.parquet, OUT_DIR/data/val.parquet (prompts "123+456=", all with carries
       in the share --carry-share, ground truth the sum)
       OUT_DIR/reward_exact.py (1.0 when the response's first number is the sum, else 0.0)
       OUT_DIR/sft.json (the supervised phase: steps, loss, accuracy on carry-free and carrying sums)
"""
import argparse
import json
import os
import random

import pandas as pd
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("0123456789+= \n") + ["user", "assistant"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_FRAME = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
REWARD = '''import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Exact match: 1.0 when the response's first number is the sum, else 0.0."""
    found = re.search(r"\\d+", solution_str or "")
    return 1.0 if found is not None and found.group(0) == str(ground_truth) else 0.0
'''


def carries(a: int, b: int) -> bool:
    return any((a // 10**i % 10) + (b // 10**i % 10) >= 10 for i in range(3))


def draw(rng: random.Random, *, carry: bool) -> tuple[int, int]:
    while True:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if carries(a, b) == carry:
            return a, b


def build_tokenizer(mdir: str) -> PreTrainedTokenizerFast:
    """One token a character (and a token each for the chat roles): digits stay digits."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"user|assistant|."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # "579", not "5 7 9": the reward reads the decoded response
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"], model_max_length=512,
                                 padding_side="left")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(mdir)
    return hf


def sft(model: Qwen2ForCausalLM, hf: PreTrainedTokenizerFast, rng: random.Random, args: argparse.Namespace) -> dict:
    """Teach the format and carry-free sums; returns what was learnt."""
    device = torch.device(args.device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)

    def encode(a: int, b: int) -> tuple[list[int], int]:
        prompt = hf(CHAT_FRAME.format(f"{a}+{b}="))["input_ids"]
        answer = hf(f"{a + b}<|im_end|>")["input_ids"]
        return prompt + answer, len(prompt)

    losses = []
    for step in range(args.sft_steps):
        batch = [encode(*draw(rng, carry=rng.random() < args.sft_carry_share)) for _ in range(args.sft_batch)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), hf.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for i, (seq, n_prompt) in enumerate(batch):
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, n_prompt:len(seq)] = torch.tensor(seq[n_prompt:])
        out = model(input_ids=ids.to(device), labels=labels.to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    model.eval()
    return {"steps": args.sft_steps, "final_loss": sum(losses[-20:]) / min(20, len(losses)),
            "accuracy_no_carry": accuracy(model, hf, rng, carry=False, device=device),
            "accuracy_carry": accuracy(model, hf, rng, carry=True, device=device)}


@torch.no_grad()
def accuracy(model: Qwen2ForCausalLM, hf: PreTrainedTokenizerFast, rng: random.Random, *, carry: bool,
             device: torch.device, n: int = 256) -> float:
    pairs = [draw(rng, carry=carry) for _ in range(n)]
    prompts = [hf(CHAT_FRAME.format(f"{a}+{b}="))["input_ids"] for a, b in pairs]
    width = max(map(len, prompts))
    ids = torch.tensor([[hf.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = (ids != hf.pad_token_id).long()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=hf.pad_token_id, eos_token_id=hf.eos_token_id)
    texts = hf.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(t.strip().startswith(str(a + b)) for t, (a, b) in zip(texts, pairs)) / n


def write_data(ddir: str, rng: random.Random, carry_share: float) -> None:
    def rows(n: int, split: str) -> pd.DataFrame:
        out = []
        for i in range(n):
            a, b = draw(rng, carry=rng.random() < carry_share)
            out.append({"data_source": "addition", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                        "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                        "extra_info": {"split": split, "index": i, "carry": carries(a, b)}})
        return pd.DataFrame(out)

    rows(8192, "train").to_parquet(os.path.join(ddir, "train.parquet"))
    rows(256, "test").to_parquet(os.path.join(ddir, "val.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--sft-batch", type=int, default=256)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--sft-carry-share", type=float, default=0.1,
                        help="share of supervised sums that carry: few, so that carrying is learnt imperfectly")
    parser.add_argument("--carry-share", type=float, default=0.7, help="share of RL prompts whose sum carries")
    args = parser.parse_args()
    mdir, ddir = os.path.join(args.out, "model"), os.path.join(args.out, "data")
    os.makedirs(mdir, exist_ok=True)
    os.makedirs(ddir, exist_ok=True)
    random.seed(0)
    torch.manual_seed(0)
    rng = random.Random(0)
    hf = build_tokenizer(mdir)
    heads = max(1, args.hidden // 64)
    cfg = Qwen2Config(vocab_size=len(hf), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      head_dim=64, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=hf.pad_token_id, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id)
    cfg.architectures = ["Qwen2ForCausalLM"]
    model = Qwen2ForCausalLM(cfg)
    report = sft(model, hf, rng, args)
    report["params"] = sum(p.numel() for p in model.parameters())
    model.to("cpu").to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(mdir, safe_serialization=True)
    GenerationConfig(eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                     bos_token_id=hf.pad_token_id).save_pretrained(mdir)
    write_data(ddir, rng, args.carry_share)
    with open(os.path.join(args.out, "reward_exact.py"), "w") as f:
        f.write(REWARD)
    with open(os.path.join(args.out, "sft.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
