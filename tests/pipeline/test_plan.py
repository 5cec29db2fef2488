"""`draftsmith plan` against numbers worked out by hand (the arithmetic is written out in the comments; nothing
here calls the formula code to get an expected value), for two configurations:

A. the tiny 2-layer target of tests/tiny.py (hidden 64, 4/2 heads x 16, MLP 128, vocab 384): EAGLE-3 on
   offline fp32 features, one fp32 process (DDP, stage 0);
B. a hand-written Llama-style config (hidden 1024, 16 layers, 16/4 heads x 64, MLP 2816, vocab 32000): EAGLE-3
   and DSpark, online features from a target split 8 ways by ZeRO-3 inference, 8 ranks of ZeRO-2 in bf16.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.pipeline.cli import main
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.plan import DrafterShape, dspark_params, eagle3_params, make_plan

MiB = 2**20


# ------------------------------------------------------------------------------------- A: tiny target


@pytest.fixture
def plan_a(tiny_target_dir):
    cfg = load_config(
        None,
        [
            f"model.target={tiny_target_dir}",
            "collect.aux_layer_ids=[0,1,2]",
            "collect.dtype=float32",
            "train.batch_tokens=160",
            "train.eagle3.ttt_steps=3",
            "train.draft_vocab_size=256",
            "train.mixed_precision='no'",
        ],
    )
    return make_plan(cfg, tokens=10_000, world=1)


def test_a_parameters(plan_a):
    p = plan_a.drafters[0]["params"]
    # H=64, q width = 4 heads x 16 = 64, kv width = 2 x 16 = 32, MLP 128, 3 aux layers, D=256, V=384
    # fc 3*64*64 = 12288
    # layer: q 2H*64 = 8192, k+v 2*(2H*32) = 8192, o 64*64 = 4096, MLP 3*64*128 = 24576, 3 norms 192 -> 45248
    # final norm 64; lm_head 256*64 = 16384; confidence (128*256 + 256) + (256 + 1) = 33281
    assert p["trainable"] == 12288 + 45248 + 64 + 16384 + 33281 == 107265
    assert p["frozen"] == 384 * 64 == 24576  # the target's embedding


def test_a_disk(plan_a):
    # (3 aux + final) x 64 x 4 B (fp32) + 4 B token id + 1 B mask = 1029 B/token (collect reported 1029 too)
    assert plan_a.feature_bytes_per_token == 1029
    assert plan_a.tokens == 10_000 and plan_a.feature_disk_bytes == 10_290_000


def test_a_memory(plan_a):
    m = plan_a.drafters[0]["memory_bytes"]
    # fp32 DDP: weights 4 B, gradients 4 B, two Adam moments 8 B per trainable parameter; frozen 4 B
    assert m["drafter weights"] == 429_060 and m["gradients"] == 429_060
    assert m["optimizer (master + moments)"] == 858_120 and m["frozen drafter weights"] == 98_304
    # TTT unroll and losses, T = 160 tokens, a = 4 B, k = 3 steps, 1 layer, temperature 1 (exact teacher kept),
    # flex; per token:
    #   layer: 4*(9*64 + 4*128) = 4352; attention: step 0 (5*4 + 2*2)*16*4 = 1536; steps >= 1 keep q, k, v and
    #   o_proj's input (2*4 + 2*2)*16*4 = 768, the rows' lse 4*4 = 16, flex's output 4*16*4 = 256 and the k/v of
    #   steps 0..i (1+i)*2*2*16*4 = 512 (i=1), 768 (i=2)
    #   step 0: 160*5888 = 942,080; step 1: 160*(4352 + 1552) = 944,640; step 2: 160*(4352 + 1808) = 985,600
    #   heads per step: 160*(256*4 + (4*64 + 512)*4) = 160*4096 = 655,360 (logits only: the fused step terms)
    #   the last step's logits gradient when backward starts: 160*256*4 = 163,840
    #   inputs: 160*4*64*4 (features) + 160*64*4 (fc) + 2*160*256*4 (teacher probs + exact) = 532,480
    # 532,480 + 942,080 + 944,640 + 985,600 + 3*655,360 + 163,840 = 5,534,720 (nothing quadratic in T)
    assert m["activations (TTT unroll)"] == 5_534_720
    assert m["teacher lm_head (fp32)"] == 4 * 384 * 64 == 98_304
    assert m["teacher logits (one chunk)"] == 160 * 384 * 8 == 491_520
    # the teacher cache at its fullest: all 10,000 tokens x (4 B argmax + 4 B logsumexp at temperature 1)
    assert m["teacher cache"] == 80_000
    # the teacher's logits are freed before the unroll: the total counts the larger (the activations)
    # 429,060*2 + 858,120 + 98,304 + 5,534,720 + 98,304 + 80,000 = 7,527,568
    assert plan_a.drafters[0]["memory_total_bytes"] == 7_527_568


def test_a_long_sequences(plan_a):
    """The same drafter with one sequence of L tokens per micro-batch: per token, the steps' layers 5888 + 5904 +
    6160, the heads 3*4096, the last logits' gradient 256*4 = 1024, the inputs 1024 + 256 + 2048 = 3328 -> 34,592 B;
    plus the weights, gradients, moments, frozen embedding, teacher head and teacher cache (1,912,848 + 80,000 =
    1,992,848 B); the teacher's logits (2048*384*8 = 6,291,456) are smaller than the activations."""
    long = plan_a.drafters[0]["long_sequence_memory_bytes"]
    # 34,592*4096 + 1,992,848 = 143,681,680; 34,592*8192 + ... = 285,370,512; 34,592*16384 + ... = 568,748,176
    assert long == {"4096": 143_681_680, "8192": 285_370_512, "16384": 568_748_176}


def test_eagle3_activations_are_linear_in_sequence_length():
    """Issue 20: with the TTT attention of drafters/ttt_attention.py nothing is quadratic in T, on either path;
    the chunked path (CPU) keeps no concatenated keys/values, flex (CUDA) keeps those of steps 0..i."""
    from draftsmith.pipeline.plan import eagle3_activation_bytes

    d = DrafterShape("eagle3", 64, 2, 4, 2, 16, 128, 3, 256, 384)
    for attention in ("flex", "chunked"):
        for ckpt in (False, True):
            one = eagle3_activation_bytes(d, 7, 1000, 2, 2, ckpt, attention=attention)
            assert eagle3_activation_bytes(d, 7, 8000, 2, 2, ckpt, attention=attention) == 8 * one
    flex = eagle3_activation_bytes(d, 3, 160, 4, 4, False, attention="flex")
    chunked = eagle3_activation_bytes(d, 3, 160, 4, 4, False, attention="chunked")
    # 2 layers x (flex's output 256 + the concatenated k/v of steps 0..i: 512 at i=1, 768 at i=2), as in test A
    assert flex - chunked == 2 * 160 * ((256 + 512) + (256 + 768))


def test_eagle3_step_peak_is_gradients_and_the_larger_of_teacher_and_activations():
    from draftsmith.pipeline.plan import eagle3_activation_bytes, eagle3_step_peak_bytes

    d = DrafterShape("eagle3", 64, 1, 4, 2, 16, 128, 3, 256, 384)
    # fp32, one process: gradients 4 B per trainable parameter (107,265, test A)
    act = eagle3_activation_bytes(d, 3, 160, 0, 4, False, attention="chunked")
    assert eagle3_step_peak_bytes(d, 3, 160, 4, attention="chunked") == 4 * 107_265 + act
    # one token of a 100k vocabulary: the teacher's logits (100,000*8 B) outweigh the unroll (13,312 B: step 0's
    # layer 5888, heads 4096, the logits' gradient 1024, fc 256 and teacher 2048)
    big_vocab = DrafterShape("eagle3", 64, 1, 4, 2, 16, 128, 3, 256, 100_000)
    assert eagle3_activation_bytes(big_vocab, 1, 1, 0, 4, False) == 13_312
    assert eagle3_step_peak_bytes(big_vocab, 1, 1, 4) == 4 * 107_265 + 800_000


def test_a_flops(plan_a):
    f = plan_a.drafters[0]["flops_per_token"]
    # mean record = min(2048, 256 prompt + 512 new tokens) = 768
    assert f["drafter"] == 6 * 107265 * 3 == 1_930_770
    # causal attention over step 0's keys at every step (flex's block mask / the chunked path skip masked keys)
    assert f["drafter attention"] == 4 * 16 * 768 * 6 * 3 == 884_736
    assert f["teacher head"] == 2 * 384 * 64 == 49_152
    assert plan_a.drafters[0]["flops_per_token_total"] == 2_864_658


def test_eagle3_formula_counts_the_real_module(tiny_target_dir):
    from transformers import AutoConfig

    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.vocab import select_draft_vocab

    config = AutoConfig.from_pretrained(tiny_target_dir)
    d2t, t2d = select_draft_vocab(torch.arange(384), 256)
    for layers in (1, 2):
        model = Eagle3Drafter.from_target(config, [0, 1, 2], 256, torch.zeros(384, 64), d2t, t2d, num_layers=layers)
        shape = DrafterShape("eagle3", 64, layers, 4, 2, 16, 128, 3, 256, 384)
        p = eagle3_params(shape)
        assert p.trainable == sum(t.numel() for t in model.parameters() if t.requires_grad)
        assert p.frozen == sum(t.numel() for t in model.parameters() if not t.requires_grad)


def test_dspark_formula_counts_the_real_module(tiny_target_dir):
    from transformers import AutoConfig

    from draftsmith.drafters.dspark import DSparkDrafter
    from draftsmith.drafters.vocab import select_draft_vocab

    config = AutoConfig.from_pretrained(tiny_target_dir)
    d2t, t2d = select_draft_vocab(torch.arange(384), 256)
    model = DSparkDrafter.from_target(
        config, [0, 1, 2], 256, torch.zeros(384, 64), d2t, t2d, torch.zeros(384, 64), num_layers=2, markov_rank=16
    )
    p = dspark_params(
        DrafterShape("dspark", 64, 2, 4, 2, 16, 128, 3, 256, 384, markov_rank=16, block_size=4, anchors=8)
    )
    assert p.trainable == sum(t.numel() for t in model.parameters() if t.requires_grad)
    assert p.frozen == sum(t.numel() for t in model.parameters() if not t.requires_grad)


# ------------------------------------------------------------------------ B: hand-written Llama config

LLAMA_B = {
    "model_type": "llama",
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


@pytest.fixture
def plan_b(tmp_path):
    from pathlib import Path

    from draftsmith.pipeline.plan import load_target_config

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_B))
    ds = Path(__file__).resolve().parents[2] / "launch" / "ds_zero2.json"
    cfg = load_config(
        None,
        [
            "model.target=org/llama-b",
            "model.zero3=gpu",
            "collect.aux_layer_ids=[2,6,10,14]",
            "train.features=online",
            "train.drafters=[eagle3,dspark]",
            f"train.deepspeed={ds}",
            "train.batch_tokens=4096",
            "train.eagle3.ttt_steps=7",
            "train.draft_vocab_size=8000",
            "train.gradient_checkpointing=true",
            "data.max_length=2048",
            "train.dspark.block_size=8",
            "train.dspark.num_layers=2",
            "train.dspark.markov_rank=128",
            "train.dspark.anchors_per_sequence=64",
            "train.dspark.aux_layer_ids=[2,14]",
        ],
    )
    config = load_target_config(cfg, str(tmp_path / "config.json"))
    return make_plan(cfg, target_config=config, records=1000, world=8)


def test_b_target_and_disk(plan_b):
    t = plan_b.target
    # embedding + head 2*32000*1024 = 65,536,000; per layer q 1,048,576 + k,v 524,288 + o 1,048,576
    # + MLP 3*1024*2816 = 8,650,752 + norms 2048 = 11,274,240; x16 = 180,387,840; final norm 1024
    assert t["params"] == 245_924_864 and t["body_params"] == 180_388_864
    assert plan_b.layout["zero_stage"] == 2 and plan_b.layout["target_shards"] == 8  # from ds_zero2.json, zero3=gpu
    # (4 aux + final) x 1024 x 2 B + 5 = 10,245 B/token; 1000 records x 768 tokens = 768,000 tokens
    assert plan_b.feature_bytes_per_token == 10_245 and plan_b.tokens == 768_000
    assert plan_b.feature_disk_bytes == 7_868_160_000


def test_b_eagle3(plan_b):
    d = plan_b.drafters[0]
    assert d["family"] == "eagle3"
    # fc 4*1024^2 = 4,194,304; layer: q 2048*1024 = 2,097,152, k+v 2*2048*256 = 1,048,576, o 1,048,576,
    # MLP 8,650,752, norms 3072 -> 12,848,128; norm 1024; lm_head 8000*1024 = 8,192,000; confidence 524,801
    assert d["params"]["trainable"] == 25_760_257 and d["params"]["frozen"] == 32_768_000
    m = d["memory_bytes"]
    # ZeRO-2 bf16 over 8: weights 2 B, frozen 2 B, gradients 2/8 B, master + moments 12/8 B
    assert m["drafter weights"] == 51_520_514 and m["frozen drafter weights"] == 65_536_000
    assert m["gradients"] == pytest.approx(6_440_064.25) and m["optimizer (master + moments)"] == pytest.approx(
        38_640_385.5
    )
    # checkpointed unroll, T=4096, a=2, k=7 (online: no stored features), temperature 1, flex:
    #   inputs 4096*1024*2 + 2*4096*8000*4 = 270,532,608
    #   kept step inputs + k/v: 7*4096*2*(2048 + 512) = 146,800,640
    #   one rebuilt step (the last, i=6), per token: 2*(9*1024 + 4*2816) = 40,960, the norms' fp32 copies
    #   3*1024*4 = 12,288, attention (2*16 + 2*4)*64*2 + 16*4 + 16*64*2 + 7*2*4*64*2 = 14,400 -> x4096 = 277,086,208
    #   heads 7*4096*(8000*2 + (4096 + 512)*2 + 1024*4) = 840,433,664 (logits only: the fused step terms)
    #   the last step's logits gradient 4096*8000*2 = 65,536,000
    assert m["activations (TTT unroll)"] == 1_600_389_120
    assert m["teacher logits (one chunk)"] == 2048 * 32000 * 8 == 524_288_000
    assert m["target weights (bf16)"] == 245_924_864 * 2 / 8 == 61_481_216
    # one forward's working set: 4096 * ((4+1)*1024 + 4*1024 + 2*2816) * 2 = 121,634,816
    assert m["target forward"] == 121_634_816
    # the teacher cache: 1,000 records x 768 tokens x 8 B
    assert m["teacher cache"] == 768_000 * 8 == 6_144_000
    # weights, gradients, optimizer, activations, fp32 teacher head, target, teacher cache; the teacher's logits
    # (smaller than the activations) are not counted
    assert d["memory_total_bytes"] == pytest.approx(2_082_858_115.75)  # 51,520,514 + 65,536,000 + 6,440,064.25
    # + 38,640,385.5 + 1,600,389,120 + 4*32000*1024 (fp32 teacher head) + 61,481,216 + 121,634,816 + 6,144,000
    f = d["flops_per_token"]
    assert f["drafter"] == 6 * 25_760_257 * 7 == 1_081_930_794
    assert f["drafter attention"] == 16 * 64 * 768 * 6 * 7 == 33_030_144
    # target: 2 * 180,388,864 + 2 * 16 layers * 16 heads * 64 * 768 = 360,777,728 + 25,165,824
    assert f["target forward"] == 385_943_552
    assert d["flops_per_token_total"] == 1_081_930_794 + 33_030_144 + 2 * 32000 * 1024 + 385_943_552


def test_b_dspark(plan_b):
    d = plan_b.drafters[1]
    assert d["family"] == "dspark" and d["shape"]["n_aux"] == 2
    # fc 2*1024^2 = 2,097,152 + hidden_norm 1024; per layer q 1,048,576 + k,v 524,288 + o 1,048,576 + q/k norms 128
    # + MLP 8,650,752 + 2 norms 2048 = 11,274,368, x2; norm 1024; Markov W1 32000*128 = 4,096,000 and
    # W2 128*8000 = 1,024,000; confidence 1024 + 128 + 1 = 1153
    assert d["params"]["trainable"] == 29_769_089 and d["params"]["lookup"] == 4_096_000
    assert d["params"]["frozen"] == 8000 * 1024 + 32000 * 1024 == 40_960_000  # lm_head rows + embedding
    m = d["memory_bytes"]
    assert m["drafter weights"] == 59_538_178 and m["frozen drafter weights"] == 81_920_000
    # 2 sequences of 2048 per micro-batch, 64 anchors each, blocks of 8 -> 1024 slots; a = 2:
    #   per layer: context k/v 4096*2*4*64*2 = 4,194,304; slots 1024*2*(4096 + 40*64 + 8448) = 30,932,992;
    #   log-sum-exp 1024*16*4 = 65,536 -> 35,192,832, x2 layers (no mask, no repeated k/v: the packed attention)
    #   inputs 2*4096*1024*2 = 16,777,216
    #   heads 1024*8000*10 + 1024*8128*2 + 1024*8000*4 + 1024*1152*2 = 133,693,440
    assert m["activations (anchor blocks)"] == 220_856_320
    assert d["memory_total_bytes"] == pytest.approx(734_742_435.75)  # fp32 teacher head; teacher cache 6,144,000
    f = d["flops_per_token"]
    # ρ = 64 anchors * 8 / 768 = 2/3 block slots per context token
    assert f["drafter (context)"] == 6 * (2 * 1024 * 1024 + 2 * 2 * 1024 * 256) == 18_874_368
    assert f["drafter (blocks)"] == pytest.approx(2 / 3 * 6 * (29_769_089 - 4_096_000 - 2_097_152))  # 94,303,748
    assert f["drafter attention"] == pytest.approx(2 / 3 * 12 * 16 * 64 * (768 + 512) * 2)  # 20,971,520
    assert f["frozen lm_head"] == pytest.approx(2 / 3 * 4 * 8000 * 1024)
    assert f["teacher head"] == pytest.approx(2 / 3 * 2 * 32000 * 1024)
    assert d["flops_per_token_total"] == pytest.approx(585_629_188)


def test_zero_stages_and_offload_partition_the_optimizer(tiny_target_dir):
    """The same drafter under each ZeRO stage on 8 ranks, bf16: the per-rank bytes per trainable parameter are
    16 (DDP: fp32 weights + grads + moments), 2+2+12/8, 2+2/8+12/8, 2/8+2/8+12/8."""
    cfg = load_config(
        None, [f"model.target={tiny_target_dir}", "collect.aux_layer_ids=[0,1,2]", "train.draft_vocab_size=256"]
    )
    per_param = {}
    for stage in (0, 1, 2, 3):
        m = make_plan(cfg, tokens=1, world=8, zero_stage=stage).drafters[0]["memory_bytes"]
        per_param[stage] = (m["drafter weights"] + m["gradients"] + m["optimizer (master + moments)"]) / 107265
    assert per_param == pytest.approx({0: 16.0, 1: 5.5, 2: 3.75, 3: 2.0})


def test_plan_command(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "configs/smollm2-eagle3.yaml",
                f"model.target={tiny_target_dir}",
                "collect.aux_layer_ids=[0,1,2]",
                "--tokens",
                "1000",
                "--world-size",
                "2",
                "--json",
                str(out),
                f"run_dir={tmp_path / 'run'}",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    text = captured.out + captured.err  # the console writes to stderr
    assert "bytes/token" in text and "GPU memory per rank" in text and "FLOPs per training token" in text
    assert json.loads(out.read_text())["layout"]["world"] == 2
    assert not (tmp_path / "run").exists()  # plan writes nothing into the run directory


def test_hub_target_without_config_is_a_clear_error(tmp_path, capsys):
    assert (
        main(["plan", "configs/smollm2-eagle3.yaml", "model.target=nobody/unknown-model", f"run_dir={tmp_path}"]) == 2
    )
    captured = capsys.readouterr()
    assert "--target-config" in captured.out + captured.err
