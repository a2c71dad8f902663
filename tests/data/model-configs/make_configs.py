"""Writes the config.json stand-ins of the models verl's example scripts name (see README.md).
Only the fields verl-sweep reads; run it to regenerate: python make_configs.py"""
import json
from pathlib import Path

HERE = Path(__file__).parent


def dense(h, inter, layers, heads, kv, vocab, *, hd=None, tie=False, arch="Qwen3ForCausalLM", mt="qwen3", **extra):
    c = {"architectures": [arch], "model_type": mt, "hidden_size": h, "intermediate_size": inter,
         "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
         "vocab_size": vocab, "tie_word_embeddings": tie, "torch_dtype": "bfloat16"}
    if hd:
        c["head_dim"] = hd
    c.update(extra)
    return c


def moe(h, layers, heads, kv, vocab, experts, moe_inter, *, hd=128, inter=None, shared=0, tie=False,
        arch="Qwen3MoeForCausalLM", mt="qwen3_moe", **extra):
    c = dense(h, inter or moe_inter * 8, layers, heads, kv, vocab, hd=hd, tie=tie, arch=arch, mt=mt,
              num_experts=experts, moe_intermediate_size=moe_inter, **extra)
    if shared:
        c["shared_expert_intermediate_size"] = shared
    return c


def vl(text, arch, mt):
    return {"architectures": [arch], "model_type": mt, "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}


def mla(h, layers, heads, vocab, experts, moe_inter, *, inter, shared, first_dense, q_lora=1536, arch="DeepseekV3ForCausalLM"):
    return {"architectures": [arch], "model_type": "deepseek_v3", "hidden_size": h, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "q_lora_rank": q_lora, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128, "n_routed_experts": experts, "moe_intermediate_size": moe_inter,
            "n_shared_experts": shared, "first_k_dense_replace": first_dense, "vocab_size": vocab,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


qwen3_8b = dense(4096, 12288, 36, 32, 8, 151936, hd=128)
qwen3_30b = moe(2048, 48, 32, 4, 151936, 128, 768, inter=6144, num_experts_per_tok=8)
qwen3_235b = moe(4096, 94, 64, 4, 151936, 128, 1536, inter=12288, num_experts_per_tok=8)
qwen25_7b = dense(3584, 18944, 28, 28, 4, 152064, arch="Qwen2ForCausalLM", mt="qwen2")
hybrid4 = {"full_attention_interval": 4}

CONFIGS = {
    # transcribed: Hugging Face model cards / THUDM/slime scripts/models (commit 624b824)
    "Qwen/Qwen3-8B": qwen3_8b,
    "Qwen/Qwen3-4B": dense(2560, 9728, 36, 32, 8, 151936, hd=128, tie=True),
    "Qwen/Qwen3-0.6B": dense(1024, 3072, 28, 16, 8, 151936, hd=128, tie=True),
    "Qwen/Qwen3-1.7B": dense(2048, 6144, 28, 16, 8, 151936, hd=128, tie=True),
    "Qwen/Qwen3-32B": dense(5120, 25600, 64, 64, 8, 151936, hd=128),
    "Qwen/Qwen3-30B-A3B": qwen3_30b,
    "Qwen/Qwen3-30B-A3B-Base": qwen3_30b,
    "Qwen/Qwen3-30B-A3B-Instruct-2507": qwen3_30b,
    "Qwen/Qwen3-235B-A22B": qwen3_235b,
    "Qwen/Qwen3-235B-A22B-Instruct-2507": qwen3_235b,
    "Qwen/Qwen2.5-7B": qwen25_7b,
    "Qwen/Qwen2.5-7B-Instruct": qwen25_7b,
    "Qwen/Qwen2.5-Math-7B": qwen25_7b,
    "Qwen/Qwen2.5-32B": dense(5120, 27648, 64, 40, 8, 152064, arch="Qwen2ForCausalLM", mt="qwen2"),
    "Qwen/Qwen2.5-72B-Instruct": dense(8192, 29568, 80, 64, 8, 152064, arch="Qwen2ForCausalLM", mt="qwen2"),
    "Qwen/Qwen2.5-VL-7B-Instruct": {**qwen25_7b, "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                                    "model_type": "qwen2_5_vl"},
    "Qwen/Qwen3-VL-8B-Instruct": vl(qwen3_8b, "Qwen3VLForConditionalGeneration", "qwen3_vl"),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": vl(qwen3_30b, "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
    "Qwen/Qwen3-VL-235B-A22B-Instruct": vl(qwen3_235b, "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": moe(2048, 48, 16, 2, 151936, 512, 512, hd=256, inter=5120, shared=512,
                                            arch="Qwen3NextForCausalLM", mt="qwen3_next", **hybrid4),
    "Qwen/Qwen3.5-4B": vl(dense(2560, 9216, 32, 16, 4, 248320, hd=256, tie=True, **hybrid4),
                          "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "Qwen/Qwen3.5-27B": vl(dense(5120, 17408, 64, 24, 4, 248320, hd=256, **hybrid4),
                           "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "Qwen/Qwen3.5-35B-A3B": vl(moe(2048, 40, 16, 2, 248320, 256, 512, hd=256, shared=512, **hybrid4),
                               "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    "deepseek-ai/DeepSeek-V3": mla(7168, 61, 128, 129280, 256, 2048, inter=18432, shared=1, first_dense=3),
    "moonshotai/Moonlight-16B-A3B": mla(2048, 27, 16, 163840, 64, 1408, inter=11264, shared=2, first_dense=1,
                                        q_lora=None),
    "XiaomiMiMo/MiMo-7B-RL": dense(4096, 11008, 36, 32, 8, 151680, hd=128, arch="MiMoForCausalLM", mt="mimo"),
    "mistralai/Mistral-Nemo-Instruct-2407": dense(5120, 14336, 40, 32, 8, 131072, hd=128, arch="MistralForCausalLM",
                                                  mt="mistral"),
    "openbmb/MiniCPM-o-2_6": {**dense(3584, 18944, 28, 28, 4, 151700, arch="MiniCPMO", mt="minicpmo")},
    "zai-org/GLM-4.1V-9B-Thinking": vl(dense(4096, 13696, 40, 32, 2, 151552, arch="Glm4vForConditionalGeneration",
                                             mt="glm4v_text"), "Glm4vForConditionalGeneration", "glm4v"),
    "openai/gpt-oss-20b": moe(2880, 24, 64, 8, 201088, 32, 2880, hd=64, inter=2880, arch="GptOssForCausalLM",
                              mt="gpt_oss", num_local_experts=32),
    "ByteDance-Seed/Seed-OSS-36B-Base": dense(5120, 27648, 64, 80, 8, 155136, hd=128, arch="SeedOssForCausalLM",
                                              mt="seed_oss"),
    # approximate stand-ins (no source on this machine): plausible shapes of the size the name says
    "Qwen/Qwen3.5-2B": vl(dense(2048, 6144, 24, 8, 2, 248320, hd=256, tie=True, **hybrid4),
                          "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "Qwen/Qwen3.5-122B-A10B": vl(moe(3072, 48, 32, 2, 248320, 256, 1024, hd=256, shared=1024, **hybrid4),
                                 "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    "Qwen/Qwen3.5-397B-A17B": vl(moe(4096, 60, 32, 2, 248320, 512, 1024, hd=256, shared=1024, **hybrid4),
                                 "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    "deepseek-ai/DeepSeek-V4-Flash": mla(4096, 43, 64, 129280, 256, 2048, inter=12288, shared=1, first_dense=3),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": moe(2688, 52, 32, 2, 131072, 64, 1024, hd=128, inter=1856,
                                                      shared=3712, arch="NemotronHForCausalLM", mt="nemotron_h",
                                                      full_attention_interval=9),
    "moonshotai/Kimi-K2.6": mla(7168, 61, 64, 163840, 384, 2048, inter=18432, shared=1, first_dense=1),
    "tencent/Hy3": moe(6144, 64, 64, 8, 128000, 192, 2048, hd=128, inter=18432, shared=2048,
                       arch="HunYuanMoEV1ForCausalLM", mt="hunyuan_v1_moe"),
}

for name, config in CONFIGS.items():
    path = HERE / (name.replace("/", "--") + ".json")
    path.write_text(json.dumps(config, indent=1) + "\n")
